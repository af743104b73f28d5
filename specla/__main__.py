import sys

from specla.cli import main

sys.exit(main())
