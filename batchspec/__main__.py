import sys

from batchspec.cli import main

sys.exit(main())
