"""Run plumbing shared by every entry point: the config tree and its loading, setup and the resource plan,
placement on Ray, logging, start-up failures, the run record and report, and host facts."""
