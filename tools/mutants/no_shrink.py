"""pytest plugin for mutant runs (`-p hybridqual.mutants.no_shrink`): hypothesis reports the first failing example
without shrinking it — a mutant only needs to be caught, and shrinking a broken engine can take minutes."""
from hypothesis import Phase, settings

settings.register_profile("mutants", phases=[Phase.explicit, Phase.reuse, Phase.generate], database=None)
settings.load_profile("mutants")
