"""Streaming output: `write_video_stream` (and the grid and per-sample writers) write `decode_iter`'s chunks to the same
mp4 a non-streamed save of the plain decode writes. That the chunks (plain or tiled, any batch) are the plain decode's
frames is tests/vae_kernel/test_decoder_variants.py's `test_decode_iter_yields_the_decode_in_consecutive_chunks`."""

from __future__ import annotations

import imageio
import imageio_ffmpeg
import numpy as np
import pytest
import torch

from _decoder_allowance import latents
from fastvideo_pan2_ext.vae_kernel import WanVAEDecoder
from fastvideo_pan2_ext.media.video_io import (grid_frames, mp4_size, to_uint8_frames, write_grid_stream, write_video_stream,
                                         write_videos_stream)

SHAPE = (2, 8, 3, 3, 3)  # batch 2, odd latent height: 48 x 48 px frames, 9 frames, two passes


@pytest.fixture(scope="module")
def plain(wan22_state_dict):
    z = latents(SHAPE, seed=11)
    decoder = WanVAEDecoder(wan22_state_dict, device="cpu", frames_per_pass=2, backend="torch")
    return z, decoder, decoder.decode(z)


def _frames(path) -> np.ndarray:
    reader = imageio_ffmpeg.read_frames(str(path))
    meta = reader.__next__()
    width, height = meta["size"]
    return np.stack([np.frombuffer(f, np.uint8).reshape(height, width, 3) for f in reader])


def test_streamed_mp4_is_byte_identical_to_saving_the_plain_decode(plain, tmp_path):
    z, decoder, expected = plain
    one = z[:1]
    written = write_video_stream(decoder.decode_iter(one), tmp_path / "streamed.mp4", fps=24)
    assert written == 4 * SHAPE[2] - 3
    imageio.mimsave(tmp_path / "whole.mp4", list(to_uint8_frames(expected[:1])), fps=24, format="mp4")
    assert (tmp_path / "streamed.mp4").read_bytes() == (tmp_path / "whole.mp4").read_bytes()
    frames = _frames(tmp_path / "streamed.mp4")
    assert frames.shape == (4 * SHAPE[2] - 3, 16 * SHAPE[3], 16 * SHAPE[4], 3)


@pytest.mark.parametrize("writer", ["one", "grid", "per sample"])
def test_a_stream_cut_off_midway_leaves_nothing_at_the_target(plain, tmp_path, writer):
    """Ctrl-C (or any error) after the first chunk: no short video at the target, no partial file beside it; while
    the stream runs, nothing is at the target."""
    z, decoder, _ = plain
    target = tmp_path / "cut.mp4"

    def cut_off():
        chunks = decoder.decode_iter(z[:1])
        yield next(chunks)
        assert not target.exists()
        raise KeyboardInterrupt

    write = {"one": lambda: write_video_stream(cut_off(), target, fps=24),
             "grid": lambda: write_grid_stream([cut_off()], target, fps=24),
             "per sample": lambda: write_videos_stream(cut_off(), [target], fps=24)}[writer]
    with pytest.raises(KeyboardInterrupt):
        write()
    assert list(tmp_path.iterdir()) == []
    assert write_video_stream(decoder.decode_iter(z[:1]), target, fps=24) == 4 * SHAPE[2] - 3
    assert [p.name for p in tmp_path.iterdir()] == ["cut.mp4"]  # no partial file (nor its folder) beside it


@pytest.mark.parametrize("error", [KeyboardInterrupt, OSError])
def test_a_video_whose_finishing_fails_is_not_moved_into_place(plain, tmp_path, monkeypatch, error):
    """An interrupt or a full disk while ffmpeg writes the file's tail (imageio's writer's close): the file may be cut
    short, so it is removed, not renamed to the target."""
    from imageio.plugins.ffmpeg import FfmpegFormat

    z, decoder, _ = plain
    finish = FfmpegFormat.Writer.close

    def failing_close(self):
        finish(self)  # ffmpeg has written all it will: the error comes at the very end
        raise error("the disk filled up as the file was finished")

    monkeypatch.setattr(FfmpegFormat.Writer, "close", failing_close)
    target = tmp_path / "tail.mp4"
    with pytest.raises(error):
        write_video_stream(decoder.decode_iter(z[:1]), target, fps=24)
    assert list(tmp_path.iterdir()) == []


def test_one_file_per_sample_for_a_batch(plain, tmp_path):
    z, decoder, expected = plain
    paths = [tmp_path / "a.mp4", tmp_path / "b.mp4"]
    assert write_videos_stream(decoder.decode_iter(z), paths, fps=24) == [4 * SHAPE[2] - 3] * 2
    for b, path in enumerate(paths):
        imageio.mimsave(tmp_path / "whole.mp4", list(to_uint8_frames(expected[b:b + 1])), fps=24, format="mp4")
        assert path.read_bytes() == (tmp_path / "whole.mp4").read_bytes()


def test_quantisation_is_fastvideos(plain):
    """FastVideo's save: x / 2 + 0.5 clamped to [0, 1] (its decode stage), then (x * 255).clamp(0, 255) -> uint8."""
    _, _, expected = plain
    unit = (expected[:1].float() / 2 + 0.5).clamp(0, 1)
    fastvideo = (unit * 255).clamp_(0, 255).to(torch.uint8)[0].permute(1, 2, 3, 0).numpy()
    assert np.array_equal(to_uint8_frames(expected[:1]), fastvideo)


def test_a_batch_into_one_file_is_a_clear_error(plain, tmp_path):
    _, _, expected = plain
    chunks = [(0, 0, expected[:1, :, :1]), (1, 0, expected[1:, :, :1])]  # what decode_iter yields for a batch
    with pytest.raises(ValueError, match=r"writes one video, but the chunks hold sample 1 \(batch > 1\): use "
                                         r"write_videos_stream"):
        write_video_stream(chunks, tmp_path / "x.mp4", fps=24)
    with pytest.raises(ValueError, match=r"must hold one sample .* got batch 2"):
        write_video_stream([torch.zeros(2, 3, 1, 16, 16)], tmp_path / "y.mp4", fps=24)


def test_one_grid_file_for_a_batch_in_lockstep(plain, tmp_path):
    """A batch as FastVideo saves one: each frame is torchvision's make_grid(nrow=6) of the samples' frames."""
    from torchvision.utils import make_grid

    z, decoder, expected = plain
    per_sample = [decoder.decode_iter(z[b:b + 1]) for b in range(SHAPE[0])]
    assert write_grid_stream(per_sample, tmp_path / "grid.mp4", fps=24) == 4 * SHAPE[2] - 3
    u8 = (((expected.float() / 2 + 0.5).clamp(0, 1)) * 255).clamp_(0, 255).to(torch.uint8)
    frames = [make_grid(u8[:, :, i], nrow=6).permute(1, 2, 0).contiguous().numpy() for i in range(u8.shape[2])]
    assert frames[0].shape == (16 * SHAPE[3] + 4, 2 * 16 * SHAPE[4] + 6, 3)  # side by side, 2-pixel padding
    imageio.mimsave(tmp_path / "whole.mp4", frames, fps=24, format="mp4")
    assert (tmp_path / "grid.mp4").read_bytes() == (tmp_path / "whole.mp4").read_bytes()
    # imageio's writer (FastVideo's too) pads frames to multiples of 16 pixels: 52x102 is stored as 64x112.
    assert mp4_size(tmp_path / "grid.mp4") == (64, 112, 4 * SHAPE[2] - 3)


def test_a_grid_of_one_sample_is_the_plain_video(plain, tmp_path):
    z, decoder, expected = plain
    assert np.array_equal(np.stack(grid_frames([expected[:1]])), to_uint8_frames(expected[:1]))
    write_grid_stream([decoder.decode_iter(z[:1])], tmp_path / "grid.mp4", fps=24)
    write_video_stream(decoder.decode_iter(z[:1]), tmp_path / "one.mp4", fps=24)
    assert (tmp_path / "grid.mp4").read_bytes() == (tmp_path / "one.mp4").read_bytes()


@pytest.mark.parametrize("per_sample, message", [
    ([[torch.zeros(1, 3, 5, 16, 16)], [torch.zeros(1, 3, 5, 16, 16), torch.zeros(1, 3, 4, 16, 16)]],
     r"samples \[0\] ran out of chunks before the others"),
    ([[torch.zeros(1, 3, 5, 16, 16)], [torch.zeros(1, 3, 5, 16, 32)]], r"the samples' chunks disagree"),
    ([[(1, 0, torch.zeros(1, 3, 1, 16, 16))]], r"must hold one sample \(decode_iter\(latents\[b:b \+ 1\]\)\)"),
    (iter([[torch.zeros(1, 3, 1, 16, 16)]]), r"non-empty list with one chunk iterable per sample"),
    ([], r"non-empty list with one chunk iterable per sample"),
])
def test_bad_grid_input_is_a_clear_error(tmp_path, per_sample, message):
    with pytest.raises(ValueError, match=message):
        write_grid_stream(per_sample, tmp_path / "g.mp4", fps=24)


@pytest.mark.parametrize("chunks, message", [
    ([torch.zeros(1, 3, 16, 16)], r"a chunk must be \[1, 3, t, H, W\]; got \[1, 3, 16, 16\]"),
    ([(0, 1, torch.zeros(1, 3, 1, 16, 16))], r"frame order: .* has 0 frames, the next chunk starts at frame 1"),
    (["frame"], r"got str"),
    ([], r"no chunks to write"),
])
def test_bad_chunks_are_clear_errors(tmp_path, chunks, message):
    with pytest.raises(ValueError, match=message):
        write_video_stream(chunks, tmp_path / "z.mp4", fps=24)


@pytest.mark.parametrize("fps", [0, -1, "24", True])
def test_fps_must_be_positive(tmp_path, fps):
    with pytest.raises(ValueError, match="fps must be a positive number"):
        write_video_stream([torch.zeros(1, 3, 1, 16, 16)], tmp_path / "z.mp4", fps=fps)
