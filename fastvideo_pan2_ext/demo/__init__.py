"""Demos and the tiny random-weight checkpoints they and the tests run on (`python -m fastvideo_pan2_ext.demo`)."""
