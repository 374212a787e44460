import sys

from hack.s3server import main

sys.exit(main())
