"""The bug zoo (DESIGN §9): realistic engine defects, each applied to a temporary copy and killed by the CPU tier.

Owns the zoo (`zoo`: each mutant's patch, story and the tests named to kill it, in order, assembled from the family
modules `zoo_engine`, `zoo_kernels`, `zoo_model`, `zoo_prefix`, `zoo_spec` and `zoo_reports` over the files and test
ids of `zoo_paths`), the runner (`runner`: a copy of the project, the patch, its named tests, the verdict) and the
blind judge (`blind`: the main job, qualify over every model, then the CPU tier, without the named tests). It runs
everything else as subprocesses in the copy, so it imports only its own modules and the standard library (hypothesis
in its pytest plugin); nothing imports it but the CLI.
"""
