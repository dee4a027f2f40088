"""Every exit status a loadlab command returns, defined once (README "Exit statuses" documents them)."""

OK = 0  # the run (or sweep) completed; failed requests are data, recorded and reported
PARTIAL = (
    1  # the run was cut short (-t, Ctrl-C, a lost master) and is partial; also a server that cannot listen
)
BAD_INPUT = 2  # a user mistake: profile, sweep file, flag, tokenizer file, run directory
TARGET = (
    3  # the target cannot be reached or refuses the key (or a sweep configuration's server or run failed)
)
CLIENT_BOUND = 4  # --strict: the run completed but the load generator limited it (its figures are suspect)
INTERRUPTED = 130  # a sweep stopped by Ctrl-C (finished runs are kept; the same command resumes)
