"""What defines the decoder's result and may be imported by the reference decoder (`reference.py`): the architecture
and its shapes (`architecture`), the arithmetic it is defined in (`precision`) and the correctness allowance
(`allowance`). Nothing here imports the rest of the decoder (tests/test_architecture.py)."""
