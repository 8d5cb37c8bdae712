"""What defines the decoder's and encoder's results and may be imported by the reference (`reference.py`): the
architecture and its shapes (`architecture`), the arithmetic it is defined in (`precision`) and the correctness
allowance (`allowance`). Nothing here imports the rest of the decoder (tests/repo/test_architecture.py)."""
