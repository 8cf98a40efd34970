"""python -m hybridqual.scenarios list|write: see hybridqual.scenarios.plan."""
import sys

from hybridqual.scenarios.plan import main

sys.exit(main())
