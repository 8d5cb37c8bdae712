"""Media in and out: `image` (a first frame's stored pixels, checked), `video_io` (mp4 writing, whole or streamed,
into files no link can redirect), `latents_file` (the kept-latents file the decode command reads). No FastVideo."""
