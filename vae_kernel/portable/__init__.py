"""The decoder network in portable PyTorch: the op table (`ops`), the prepared weights (`weights`), one pass of the
network over a band of rows (`network`), the loops over passes and tiles (`passes`) and the Winograd F(2x2, 3x3)
definition the compiled kernels mirror (`winograd`)."""
