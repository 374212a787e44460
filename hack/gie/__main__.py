import sys

from hack.gie import main

sys.exit(main())
