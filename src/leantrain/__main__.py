import sys

from leantrain.cli import main

sys.exit(main())
