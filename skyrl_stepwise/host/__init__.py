"""What every room may use, at the bottom of the house: this process's logging (run.log, the console, Ray workers'
output routed into run.log), the host's compute facts (native bf16 or not), and the lifeline that ends every process
a trainer started when the trainer ends, by any means (lifeline.py)."""
