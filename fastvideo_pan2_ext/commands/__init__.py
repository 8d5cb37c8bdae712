"""The package's commands: `decode` (`python -m fastvideo_pan2_ext.decode`, latents to video). The demo is
`python -m fastvideo_pan2_ext.demo`."""
