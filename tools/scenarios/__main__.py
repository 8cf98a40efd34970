"""python -m hybridqual.scenarios list|write: see hybridqual.scenarios.plan."""
import sys

from hybridqual.scenarios.plan import main

if __name__ == "__main__":
    sys.exit(main())
