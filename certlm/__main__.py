import sys

from certlm.cli import main

sys.exit(main())
