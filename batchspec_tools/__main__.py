import sys

from batchspec_tools.cli import main

sys.exit(main())
