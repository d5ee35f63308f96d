import sys

from pagedrag.entrypoints.cli import main

sys.exit(main())
