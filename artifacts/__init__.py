"""Run artifacts: one module per file a command writes and another reads, each with its name, a typed view and
checked `load` / atomic `save` (errors name the file; `format_version` written, older files without one read).

    trace.py      trace.npz + trace.json      (the arrays' class is `specpilot.envs.record.Trace`; here: the header)
    profile.py    profile.json                (the class is `specpilot.envs.profile.LatencyProfile`; here: the name)
    grid.py       grid.json                   `GridResult`: best cell, best drafting cell, best per temperature
    policies.py   policies.json               `PoliciesIndex`: a run's final depth / size policies + fallback
    run.py        manifest.json, best.json, checkpoints/progress.json, the run folder's layout, stage statuses
    contract.py   what a run was made with (pair, dtype, tree, suites) and the checks that refuse a mismatch
    decoder.py    decoder.json                an exported decoder's config (`specpilot export`)

This layer sits just above `specpilot.drafting` (it imports only drafting.files / errors / checks) so every layer
above reads and writes run files through it.
"""
