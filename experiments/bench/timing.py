"""How the suites time device work: wall-clock medians, replays of distinct inputs in one program,
and GPU kernel time from a profiler trace."""
