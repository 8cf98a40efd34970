"""python -m hybridqual.qualify: the main job (see hybridqual.qualify.runner)."""
import sys

from hybridqual.qualify.runner import finish_distributed, main

try:
    rc = main()
finally:
    finish_distributed()
sys.exit(rc)
