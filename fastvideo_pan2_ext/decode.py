"""`python -m fastvideo_pan2_ext.decode`: the decode command under the name users type (it lives in
`commands.decode`). Run as the main module, so that its signal handlers are in place before torch is imported."""

import runpy

if __name__ == "__main__":
    runpy.run_module("fastvideo_pan2_ext.commands.decode", run_name="__main__", alter_sys=True)
