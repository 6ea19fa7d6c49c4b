import sys

from medha.cli import main

# guarded: tensor-parallel workers are spawned, and a spawned child imports this module again
if __name__ == "__main__":
    sys.exit(main())
