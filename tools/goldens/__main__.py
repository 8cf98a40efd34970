"""python -m hybridqual.goldens regen|zoo: see hybridqual.goldens.regen."""
import sys

from hybridqual.goldens.regen import main

if __name__ == "__main__":
    sys.exit(main())
