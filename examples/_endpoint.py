"""Where the examples find the dispatcher: argv[1], else $TANDEM_ENDPOINT, else the default."""

import os
import sys

ENDPOINT = (sys.argv[1] if len(sys.argv) > 1
            else os.environ.get("TANDEM_ENDPOINT", "tcp://127.0.0.1:5550"))
