import sys

from medha.cli import main

sys.exit(main())
