import sys

from stalwart.cli import main

sys.exit(main())
