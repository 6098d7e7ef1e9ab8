import sys

from cpuinfer.cli.main import main

sys.exit(main())
