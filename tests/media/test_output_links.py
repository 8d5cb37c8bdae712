"""No file the product writes can be redirected (docs/design/outputs.md, "The streamed save and atomic output"): links
planted at every name it writes or used to write (the write probe `.<name>.probe-<pid>`, the partial file
`.<name>.partial.mp4`, the final name, a parent folder) touch no file outside the output, for `video_io` itself (the
writer every save goes through), the streamed save's two halves (the parent's partial file, the worker's writer),
the decode command and `fastvideo generate --pipeline pan2`. A victim is a file in tmp_path: its bytes and mtime
must not change. The server's part (planted links, a finished video replaced by a link) is in
tests/fastvideo_integration/serving/test_serve_hardening.py, beside its one server."""

from __future__ import annotations

import os
import stat
import sys
import threading
from pathlib import Path

import pytest
import torch

from fastvideo_pan2_ext.media.video_io import (PartialFile, check_writable, open_folder, open_written, remove_video,
                                         write_video_stream)

CHUNK = torch.zeros(1, 3, 5, 32, 48)  # five grey 48x32 frames


class Victim:
    """A file outside the output that a planted link points at: it must stay exactly as it was."""

    def __init__(self, path: Path, text: str = "root secret 42") -> None:
        self.path = path
        path.write_text(text)
        os.utime(path, (1_000_000_000, 1_000_000_000))
        self.before = (path.read_bytes(), path.stat().st_mtime_ns)

    def untouched(self) -> bool:
        return (self.path.read_bytes(), self.path.stat().st_mtime_ns) == self.before


@pytest.fixture
def victims(tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    return [Victim(outside / f"victim-{n}") for n in range(3)]


def _plant_old_names(folder: Path, name: str, victims: list[Victim]) -> list[Path]:
    """Links at the names the product used to write (its fixed partial name, its probe for this and the next pids)."""
    links = [folder / f".{name}.partial.mp4"] + [folder / f".{name}.probe-{pid}" for pid in
                                                    range(os.getpid(), os.getpid() + 50)]
    for n, link in enumerate(links):
        link.symlink_to(victims[n % len(victims)].path)
    return links


def test_the_names_written_are_random_and_never_follow_a_planted_link(tmp_path, victims):
    shared = tmp_path / "shared"
    shared.mkdir()
    links = _plant_old_names(shared, "clip.mp4", victims)
    check_writable(shared / "clip.mp4")
    assert write_video_stream([CHUNK], shared / "clip.mp4", fps=8) == 5
    video = shared / "clip.mp4"
    assert video.is_file() and not video.is_symlink() and video.read_bytes()[4:8] == b"ftyp"
    assert all(v.untouched() for v in victims) and all(link.is_symlink() for link in links)
    assert sorted(shared.iterdir()) == sorted([video, *links])  # nothing else left: no partial file, no probe
    assert stat.S_IMODE(video.stat().st_mode) == 0o666 & ~_umask()  # as an ordinary file


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def test_the_partial_file_is_in_a_private_folder_of_a_random_name(tmp_path):
    first, second = PartialFile(tmp_path / "a.mp4"), PartialFile(tmp_path / "a.mp4")
    try:
        assert first.folder != second.folder and first.folder.name.startswith(".a.mp4.")
        assert stat.S_IMODE(first.folder.stat().st_mode) == 0o700 and first.folder.stat().st_uid == os.geteuid()
        assert (first.folder / "a.mp4").is_file()  # created exclusively at once: nobody else can put it there
        assert first.path.startswith(f"/proc/{os.getpid()}/fd/")  # writers reach the folder by its descriptor
    finally:
        first.discard()
        second.discard()
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("how", ["dangling", "to a victim"])
def test_a_target_that_is_a_link_is_refused_in_one_line(tmp_path, victims, how):
    target = tmp_path / "clip.mp4"
    target.symlink_to(tmp_path / "nothing" if how == "dangling" else victims[0].path)
    for attempt in (lambda: check_writable(target), lambda: write_video_stream([CHUNK], target, fps=8)):
        with pytest.raises(OSError) as raised:
            attempt()
        assert str(raised.value) == f"cannot write the video to {target}: it is a symbolic link: a video is never " \
                                    f"written through one (remove it, or name the file itself)"
    assert target.is_symlink() and victims[0].untouched() and sorted(tmp_path.iterdir()) == [target, victims[0]
                                                                                              .path.parent]


def test_a_folder_below_the_root_that_is_a_link_is_refused_the_root_itself_may_be_one(tmp_path, victims):
    real_root = tmp_path / "real-out"
    real_root.mkdir()
    root = tmp_path / "out"  # the operator's output_dir, given as a link: theirs to give
    root.symlink_to(real_root)
    (real_root / "att").symlink_to(victims[0].path.parent)  # a member's folder, made a link to elsewhere
    with pytest.raises(OSError, match=rf"{root / 'att'} is a symbolic link \(below {root} only real folders"):
        check_writable(root / "att" / "clip.mp4", root=root)
    with pytest.raises(OSError, match="is a symbolic link"):
        PartialFile(root / "att" / "deeper" / "clip.mp4", root=root)
    assert not (victims[0].path.parent / "deeper").exists()  # no folder made through the link either
    assert write_video_stream([CHUNK], PartialFile(root / "videos" / "clip.mp4", root=root), fps=8) == 5
    with pytest.raises(OSError, match="is not under"):
        open_folder(tmp_path / "elsewhere", root)


def test_a_target_that_becomes_a_link_while_the_video_is_made_is_refused(tmp_path, victims):
    target = tmp_path / "clip.mp4"
    partial = PartialFile(target)
    write_video_stream([CHUNK], partial, fps=8)  # written in place: its maker commits
    target.symlink_to(victims[0].path)  # planted while the video was made
    with pytest.raises(OSError, match=rf"cannot write the video to {target}: it is a symbolic link"):
        partial.commit()
    assert target.is_symlink() and victims[0].untouched()
    assert sorted(tmp_path.iterdir()) == [target, victims[0].path.parent]  # the partial file went


def test_a_private_folder_swapped_for_another_is_never_written_into(tmp_path, victims):
    """Someone who may rename entries in the output folder moves the private folder away and puts a folder of theirs,
    holding a link, under its name: the writer still writes into the folder that was made (by its descriptor)."""
    target = tmp_path / "clip.mp4"
    partial = PartialFile(target)
    moved = tmp_path / "moved-away"
    partial.folder.rename(moved)
    partial.folder.mkdir()
    (partial.folder / "clip.mp4").symlink_to(victims[0].path)
    write_video_stream([CHUNK], partial, fps=8)
    assert victims[0].untouched() and (moved / "clip.mp4").stat().st_size > 0
    written = partial.commit()
    assert target.read_bytes()[4:8] == b"ftyp" and (written.device, written.inode) == (target.stat().st_dev,
                                                                                         target.stat().st_ino)
    with pytest.raises(OSError, match="its folder is not the one made for it"):  # the worker's half checks too
        PartialFile.reopen(partial.folder / "clip.mp4", partial.folder_id)


def test_the_worker_writes_into_the_parents_partial_file_only(tmp_path, victims):
    """The streamed save's halves: the parent makes the partial file, the worker reopens it by its folder's identity
    (a folder swapped in under that name is refused), writes, and the parent moves it into place."""
    target = tmp_path / "clip.mp4"
    parent = PartialFile(target)
    worker = PartialFile.reopen(parent.folder / parent.name, parent.folder_id)
    try:
        assert write_video_stream([CHUNK], worker, fps=8) == 5
    finally:
        worker.close()
    assert not target.exists()  # only the parent moves it
    written = parent.commit()
    assert target.is_file() and Path(written.path) == target and sorted(tmp_path.iterdir()) == [
        target, victims[0].path.parent]


@pytest.mark.parametrize("job_ends_by", ["discard", "commit"])
def test_a_server_stopping_while_its_job_ends_closes_each_descriptor_once(tmp_path, job_ends_by):
    """A server that stops discards its jobs' partial files from its event loop while a job's thread may be discarding
    or committing the same one (found by tests/fastvideo_integration/serving/test_serve.py's SIGTERM case: a second
    close raised EBADF and the server's cleanup stopped short of the uploads). Each ends whole: the video committed
    or refused in one line, nothing of the partial file left, no error from the other thread."""
    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # threads change hands at nearly every bytecode: the race is met in a few rounds
    errors, committed = [], 0
    try:
        for n in range(200):
            partial = PartialFile(tmp_path / f"clip{n}.mp4")
            Path(partial.path).write_bytes(b"video")
            start = threading.Barrier(2)

            def end(how):
                start.wait()
                try:
                    getattr(partial, how)()
                except OSError as exc:
                    errors.append(exc)

            threads = [threading.Thread(target=end, args=(how,)) for how in (job_ends_by, "discard")]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
            committed += (tmp_path / f"clip{n}.mp4").exists()
    finally:
        sys.setswitchinterval(switch)
    assert all("its partial file was removed" in str(exc) for exc in errors), errors[:3]
    left = list(tmp_path.iterdir())
    assert len(left) == committed and all(p.read_bytes() == b"video" for p in left)  # no partial folder left
    assert committed + len(errors) == (200 if job_ends_by == "commit" else 0)  # each commit: the video, or one line


def test_a_written_video_is_opened_and_removed_only_while_it_is_that_file(tmp_path, victims):
    target = tmp_path / "videos" / "clip.mp4"
    partial = PartialFile(target, root=tmp_path)
    write_video_stream([CHUNK], partial, fps=8)
    written = partial.commit()
    fd = open_written(written, tmp_path)
    os.close(fd)
    original = target.read_bytes()
    target.unlink()
    target.symlink_to(victims[0].path)  # a link in its place
    with pytest.raises(OSError):
        open_written(written, tmp_path)
    remove_video(target, tmp_path, (written.device, written.inode))
    assert target.is_symlink() and victims[0].untouched()
    target.unlink()
    target.write_bytes(original)  # the same bytes, another file
    with pytest.raises(OSError, match="is no longer the video written there"):
        open_written(written, tmp_path)
    remove_video(target, tmp_path, (written.device, written.inode))
    assert target.exists()  # not the file it wrote: left alone


# ------------------------------------------------------------------------------------------------ the decode command


@pytest.fixture(scope="module")
def latents_and_vae(tmp_path_factory):
    from _vae_helpers import make_wan22_vae

    folder = tmp_path_factory.mktemp("decode")
    make_wan22_vae(seed=3).save_pretrained(folder / "vae")
    torch.save(torch.randn(1, 8, 2, 2, 3, generator=torch.Generator().manual_seed(0)), folder / "z.pt")
    return folder / "z.pt", folder / "vae"


def _decode(latents_and_vae, output: Path, *extra) -> int:
    from fastvideo_pan2_ext.commands import decode

    latents, vae = latents_and_vae
    try:
        return decode.main([str(latents), "--vae", str(vae), "-o", str(output), "--fps", "8", "--denormalized",
                            "--device", "cpu", *extra])
    except SystemExit as exc:
        return exc.code


@pytest.mark.slow
def test_the_decode_command_never_writes_through_a_planted_link(latents_and_vae, tmp_path, victims, capsys):
    shared = tmp_path / "shared"  # a folder others can write in
    shared.mkdir()
    links = _plant_old_names(shared, "out.mp4", victims)
    assert _decode(latents_and_vae, shared / "out.mp4") == 0
    assert (shared / "out.mp4").is_file() and not (shared / "out.mp4").is_symlink()
    assert all(v.untouched() for v in victims) and all(link.is_symlink() for link in links)
    assert sorted(shared.iterdir()) == sorted([shared / "out.mp4", *links])
    for extra in ((), ("-y",)):  # a link at the output: refused, even where an existing file would be replaced
        (shared / "link.mp4").unlink(missing_ok=True)
        (shared / "link.mp4").symlink_to(victims[0].path)
        assert _decode(latents_and_vae, shared / "link.mp4", *extra) == 2
        errors = capsys.readouterr().err.strip().splitlines()
        assert errors == [f"python -m fastvideo_pan2_ext.decode: error: -o {shared / 'link.mp4'}: a symbolic link; "
                          f"a video is never written through one (name the file itself)"], errors
    assert all(v.untouched() for v in victims) and (shared / "link.mp4").is_symlink()
    given = tmp_path / "given"  # a folder the user names through a link: theirs to give
    given.symlink_to(shared, target_is_directory=True)
    assert _decode(latents_and_vae, given / "second.mp4") == 0 and (shared / "second.mp4").is_file()


# ------------------------------------------------------------------------------------------------ the CLI, end to end


@pytest.mark.slow
def test_fastvideo_generate_never_writes_through_a_planted_link(tiny_ckpt, tmp_path, victims):
    """One real `fastvideo generate --pipeline pan2` run (FastVideo's save, in the parent) into a shared folder full of
    links at the names the product used to write; then a link at the output itself: refused in one line before any
    model loads."""
    from _pan2_helpers import E2E_FRAMES, E2E_HEIGHT, E2E_WIDTH, FASTVIDEO_CLI, OFFLINE, run

    shared = tmp_path / "shared"
    shared.mkdir()
    links = _plant_old_names(shared, "clip.mp4", victims)

    def generate(output: Path):
        return run([FASTVIDEO_CLI, "generate", "--pipeline", "pan2", "--generator.model_path", str(tiny_ckpt),
                    "--request.prompt", "a cat", "--request.sampling.height", str(E2E_HEIGHT),
                    "--request.sampling.width", str(E2E_WIDTH), "--request.sampling.num_frames", str(E2E_FRAMES),
                    "--request.sampling.num_inference_steps", "1", "--request.sampling.guidance_scale", "1.0",
                    "--request.output.output_path", str(output)], env_extra=OFFLINE)

    proc = generate(shared / "clip.mp4")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    video = shared / "clip.mp4"
    assert video.is_file() and not video.is_symlink() and video.read_bytes()[4:8] == b"ftyp"
    assert all(v.untouched() for v in victims) and all(link.is_symlink() for link in links)
    assert sorted(shared.iterdir()) == sorted([video, *links])

    (shared / "dangling.mp4").symlink_to(tmp_path / "outside" / "new-file")
    proc = generate(shared / "dangling.mp4")
    errors = [line for line in proc.stderr.splitlines() if line.startswith("fastvideo generate: error:")]
    assert proc.returncode == 2 and errors == [
        f"fastvideo generate: error: cannot write the video to {shared / 'dangling.mp4'}: it is a symbolic link: a "
        f"video is never written through one (remove it, or name the file itself)"], proc.stderr[-3000:]
    assert not (tmp_path / "outside" / "new-file").exists() and all(v.untouched() for v in victims)
