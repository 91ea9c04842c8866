"""What every room may use, at the bottom of the house: this process's logging (run.log, the console, Ray workers'
output routed into run.log) and the host's compute facts (native bf16 or not)."""
