"""`python -m fastvideo_pan2_ext.demo`: the PAN2 pipeline demo (`demo.pan2`)."""

import sys

from fastvideo_pan2_ext.demo.pan2 import main

if __name__ == "__main__":
    sys.exit(main())
