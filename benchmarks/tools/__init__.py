"""Tools that measure nothing themselves: profilers, SASS / PTX and register reports, Nsight Compute
summaries, sanitizer cases, kernel precompilation, probes and config tuners."""
