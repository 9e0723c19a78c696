"""The transfer kernels (csrc/kernels/transport_kernels.cu) and their CPU references
(transport/_tensor_kernels.py).

* The references against independent computations on random inputs with fixed seeds: pack and
  unpack against raw memory (ctypes), the batched copy against slicing, fp8 quantisation against
  an e4m3 encoder written out here (round to nearest even from the format's definition).
* The segment field order: the copy engine's and the kernel's structs against the host's.
* The kernel image the build embeds: a fatbin holding every kernel for every listed arch.
* On a CUDA GPU (``pytest -m gpu``): each kernel against its CPU reference.
"""

from __future__ import annotations

import ctypes
import math
import os
import random
import re
import shutil
import struct
import subprocess
from pathlib import Path

import pytest
import torch

from transport import _tensor_kernels as K
from transport._native import load

FP8 = torch.float8_e4m3fn
KERNEL_NAMES = (
    "transport_batched_copy",
    "transport_amax_bf16",
    "transport_quantize_bf16_fp8",
    "transport_dequantize_fp8_bf16",
)
DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.int64, torch.uint8, torch.bool)
SIZES = (0, 1, 2, 3, 7, 8, 15, 16, 17, 31, 33, 127, 255, 1000, 4097, 65537, 100003)


def raw(t: torch.Tensor) -> bytes:
    """The bytes of a contiguous tensor, read straight from memory (not through torch views)."""
    assert t.is_contiguous() and t.device.type == "cpu"
    return ctypes.string_at(t.data_ptr(), t.numel() * t.element_size()) if t.numel() else b""


def random_tensor(g: torch.Generator, numel: int, dtype: torch.dtype, device: str = "cpu") -> torch.Tensor:
    shape = (numel,) if numel % 2 or numel < 4 else (2, numel // 2)
    if dtype == torch.bool:
        t = torch.randint(0, 2, shape, generator=g).bool()
    elif dtype == torch.uint8:
        t = torch.randint(0, 256, shape, generator=g, dtype=torch.uint8)
    elif dtype == torch.int64:
        t = torch.randint(-(2**62), 2**62, shape, generator=g, dtype=torch.int64)
    else:
        t = (torch.randn(shape, generator=g) * 10.0 ** float(torch.randint(-3, 4, (), generator=g))).to(dtype)
    return t.to(device)


def random_tensors(seed: int, count: int, device: str = "cpu") -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    sizes = [rng.choice(SIZES) if i % 3 else rng.randrange(0, 3000) for i in range(count)]
    return [random_tensor(g, n, rng.choice(DTYPES), device) for n in sizes]


def odd_offsets(rng: random.Random, tensors: list[torch.Tensor]) -> tuple[list[int], int]:
    """Byte offsets with random gaps (so mostly unaligned), and the bucket size they need."""
    offsets, pos = [], rng.randrange(0, 16)
    for t in tensors:
        offsets.append(pos)
        pos += t.numel() * t.element_size() + rng.randrange(0, 18)
    return offsets, pos + rng.randrange(0, 16)


# -- pack / unpack --------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_pack_writes_each_tensors_bytes_at_its_offset(seed):
    rng = random.Random(seed)
    tensors = random_tensors(seed, 300)
    offsets, size = odd_offsets(rng, tensors)
    out = torch.randint(0, 256, (size,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))
    expected = bytearray(raw(out))
    for t, off in zip(tensors, offsets, strict=True):
        expected[off : off + t.numel() * t.element_size()] = raw(t)
    K.pack(out, tensors, offsets)
    assert raw(out) == bytes(expected)  # tensors in place, the gaps untouched


def test_pack_reads_non_contiguous_tensors_in_logical_order():
    t = torch.arange(12, dtype=torch.float32).reshape(3, 4).t()
    out = torch.zeros(3 + 48, dtype=torch.uint8)
    K.pack(out, [t], [3])
    assert raw(out)[3:] == raw(t.contiguous())


@pytest.mark.parametrize("seed", [0, 1])
def test_unpack_round_trips_pack_exactly(seed):
    rng = random.Random(seed)
    tensors = random_tensors(100 + seed, 300)
    tensors[0] = torch.tensor([float("nan"), -0.0, float("inf")], dtype=torch.bfloat16)  # bits, not values
    offsets, size = odd_offsets(rng, tensors)
    bucket = torch.zeros(size, dtype=torch.uint8)
    K.pack(bucket, tensors, offsets)
    dsts = [torch.empty_like(t) for t in tensors]
    K.unpack(bucket, dsts, offsets, [t.dtype for t in tensors])
    for t, d in zip(tensors, dsts, strict=True):
        assert d.shape == t.shape and d.dtype == t.dtype
        assert raw(d) == raw(t)


def test_unpack_casts_to_each_destination_dtype_and_layout():
    g = torch.Generator().manual_seed(3)
    stored = [torch.randn(257, generator=g), torch.randn(4, 6, generator=g), torch.randint(-9, 9, (33,), generator=g)]
    offsets = [0, 1032, 1136]  # multiples of the stored itemsize (a cast reads through a typed view)
    bucket = torch.zeros(1500, dtype=torch.uint8)
    K.pack(bucket, stored, offsets)
    dsts = [
        torch.empty(257, dtype=torch.bfloat16),
        torch.empty(6, 4, dtype=torch.float64).t(),  # non-contiguous
        torch.empty(33, dtype=torch.float16),
    ]
    K.unpack(bucket, dsts, offsets, [t.dtype for t in stored])
    for s, d in zip(stored, dsts, strict=True):
        assert torch.equal(d, s.to(d.dtype))


def test_pack_and_unpack_refuse_bad_ranges_before_copying():
    out = torch.full((64,), 7, dtype=torch.uint8)
    a, b = torch.ones(8, dtype=torch.float32), torch.ones(4, dtype=torch.int64)  # 32 bytes each
    with pytest.raises(ValueError, match="overflows"):
        K.pack(out, [a, b], [0, 40])
    with pytest.raises(ValueError, match="overlap"):
        K.pack(out, [a, b], [0, 31])
    with pytest.raises(ValueError, match="overflows"):
        K.pack(out, [a], [-1])
    assert raw(out) == bytes([7]) * 64  # nothing was written
    dst = torch.zeros(8, dtype=torch.float32)
    with pytest.raises(ValueError, match="overflows"):
        K.unpack(out, [dst, dst], [0, 40], [torch.float32, torch.float32])
    assert not dst.any()
    with pytest.raises(ValueError):
        K.pack(out, [a], [0, 32])
    with pytest.raises(ValueError):
        K.pack(out.view(8, 8), [a], [0])


# -- batched copy ---------------------------------------------------------------------------------


def random_copies(rng: random.Random, src_len: int, dst_len: int, big: bool = False) -> list[tuple[int, int, int]]:
    """Random (dst offset, src offset, nbytes), the field order of a segment, with disjoint
    destinations in [0, dst_len), sizes of every alignment class and unaligned starts."""
    sizes = (0, 1, 2, 3, 7, 15, 16, 17, 31, 33, 100, 255, 1000, 4097) + ((70_001, 300_007) if big else ())
    copies: list[tuple[int, int, int]] = []
    pos = rng.randrange(0, 16)
    while True:
        n = rng.choice(sizes)
        if pos + n > dst_len:
            return copies
        s = rng.randrange(0, src_len - n + 1)
        copies.append((pos, s, n))
        pos += n + rng.choice((0, 0, 1, 5, 16, 33))


@pytest.mark.parametrize("seed", range(4))
def test_batched_copy_reference_matches_slicing(seed):
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    src = torch.randint(0, 256, (400_003,), dtype=torch.uint8, generator=g)
    dst = torch.randint(0, 256, (500_009,), dtype=torch.uint8, generator=g)
    copies = random_copies(rng, src.numel(), dst.numel(), big=True)
    expected = dst.clone()
    for d, s, n in copies:
        expected[d : d + n] = src[s : s + n]
    piece = rng.choice((16, 48, 4096, K.MIN_PIECE, K.MAX_PIECE))
    table = K.segment_table([(dst.data_ptr() + d, src.data_ptr() + s, n) for d, s, n in copies], piece)
    K.batched_copy_reference(table)
    assert torch.equal(dst, expected)


def test_segment_table_splits_into_aligned_pieces():
    copies = [(1000, 5003, 100), (7, 9, 0), (64, 128, 16), (3, 1, 33)]
    table = K.segment_table(copies, 48)
    assert table == [
        (1000, 5003, 48), (1048, 5051, 48), (1096, 5099, 4),
        (64, 128, 16),
        (3, 1, 33),
    ]
    with pytest.raises(ValueError):
        K.segment_table(copies, 40)
    with pytest.raises(ValueError):
        K.segment_table([(0, 0, -1)], 16)
    for total in (0, 1, 5 << 20, 100 << 20, 10 << 30):
        piece = K.piece_bytes(total)
        assert piece % 16 == 0 and K.MIN_PIECE <= piece <= K.MAX_PIECE


def struct_fields(source: Path, name: str) -> list[str]:
    """The field names of ``struct name { ... };`` in a C/C++ source, in declaration order."""
    body = re.search(rf"struct {name} \{{(.*?)\}};", source.read_text(), re.S)
    assert body is not None, f"no struct {name} in {source}"
    return re.findall(r"(\w+);", body.group(1))


def test_both_native_segment_structs_have_the_python_field_order():
    # One Segment type on the host side, (dst, src, nbytes), goes to the copy engine and to the
    # batched-copy kernel as it is. A struct reordered on one side only would copy backwards,
    # over the sources, and nothing without a GPU would notice.
    csrc = Path(__file__).resolve().parents[2] / "csrc"
    assert struct_fields(csrc / "copy_engine.h", "Segment") == ["dst", "src", "len"]
    assert struct_fields(csrc / "kernels" / "transport_kernels.cu", "Segment") == ["dst", "src", "nbytes"]
    assert K.SEGMENT_BYTES == 24


# -- fp8 ------------------------------------------------------------------------------------------


def e4m3_value(code: int) -> float:
    """The value of a non-negative finite float8 e4m3fn code (0..126), from the format's definition:
    4 exponent bits with bias 7, 3 mantissa bits, subnormals at exponent 0."""
    e, m = code >> 3, code & 7
    return m / 8 * 2.0**-6 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7)


E4M3_VALUES = torch.tensor([e4m3_value(c) for c in range(127)], dtype=torch.float64)  # ascending
TIES = (E4M3_VALUES[:-1] + E4M3_VALUES[1:]) / 2  # halfway between neighbours (5 significant bits)


def e4m3_encode(y: torch.Tensor) -> torch.Tensor:
    """float64 -> e4m3fn codes (uint8): round to nearest, ties to the even code, |y| > 448 to
    +-448. Codes at NaN inputs are unspecified (callers mask them)."""
    a = y.abs().clamp(max=448.0).nan_to_num(0.0)
    hi = torch.searchsorted(E4M3_VALUES, a).clamp(max=126)
    lo = (hi - 1).clamp(min=0)
    d_lo, d_hi = a - E4M3_VALUES[lo], E4M3_VALUES[hi] - a
    code = torch.where((d_hi < d_lo) | ((d_hi == d_lo) & (hi % 2 == 0)), hi, lo)
    return (code | (torch.signbit(y).long() << 7)).to(torch.uint8)


def expected_quantize(x: torch.Tensor) -> tuple[torch.Tensor, float]:
    """(codes, scale) computed without the reference's float32 ops: the float32 results are
    float64 results rounded once to float32, which is exact for a single division."""
    v = x.double().flatten()
    amax = v.abs().max().item() if v.numel() else 0.0
    scale = struct.unpack("f", struct.pack("f", amax / 448.0))[0] if not math.isnan(amax) else float("nan")
    if not scale > 0:
        scale = 1.0
    y = (v / scale).float().double()
    return e4m3_encode(y).view(x.shape), scale


def quantize_cases(dtype: torch.dtype) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(11)
    finfo = torch.finfo(dtype)
    cases = [torch.randn(n, generator=g).to(dtype) for n in SIZES]
    cases += [
        torch.zeros(17, dtype=dtype),
        torch.full((33,), -3.25, dtype=dtype),  # all equal: every code is -448
        (torch.rand(1001, generator=g) * 2 - 1).mul(finfo.max).to(dtype),  # huge
        (torch.randn(999, generator=g) * finfo.smallest_normal).to(dtype),  # subnormal range
        # e4m3 subnormals
        torch.cat([torch.randn(500, generator=g), torch.randn(500, generator=g) * 2.0**-12]).to(dtype),
        torch.randn(3, 5, 7, generator=g).to(dtype).transpose(0, 2),  # non-contiguous
        torch.cat([torch.tensor([448.0], dtype=torch.float64), TIES, -TIES]).to(dtype),  # scale 1, exact ties
    ]
    if dtype == torch.float32:
        cases.append(torch.full((5,), 1e-44))  # amax / 448 underflows to 0: scale 1, q 0
    return cases


def check_quantized(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> None:
    codes, expected_scale = expected_quantize(x)
    assert q.dtype == FP8 and q.shape == x.shape
    assert scale.dtype == torch.float32 and scale.dim() == 0
    assert scale.item() == expected_scale
    assert torch.equal(q.view(torch.uint8).cpu(), codes)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_quantize_fp8_reference_rounds_to_nearest_even_with_amax_scale(dtype):
    for x in quantize_cases(dtype):
        check_quantized(x, *K.quantize_fp8(x))


def test_quantize_fp8_reference_special_cases():
    q, scale = K.quantize_fp8(torch.zeros(4, dtype=torch.bfloat16))
    assert scale.item() == 1.0 and not q.view(torch.uint8).any()
    q, scale = K.quantize_fp8(torch.tensor([2.0, -2.0, 2.0], dtype=torch.bfloat16))
    assert scale.item() == torch.tensor(2.0 / 448).item()
    assert q.view(torch.uint8).tolist() == [0x7E, 0xFE, 0x7E]  # +-448
    q, scale = K.quantize_fp8(torch.tensor([], dtype=torch.bfloat16))
    assert q.numel() == 0 and scale.item() == 1.0
    # -0.0 and values that round to zero keep their sign.
    q, _ = K.quantize_fp8(torch.tensor([-0.0, 448.0, -1e-6], dtype=torch.float32))
    assert q.view(torch.uint8).tolist() == [0x80, 0x7E, 0x80]


def test_quantize_fp8_reference_non_finite_inputs():
    # A NaN makes amax NaN, hence scale 1: the NaN stays NaN, the rest saturate at +-448.
    q, scale = K.quantize_fp8(torch.tensor([1.0, float("nan"), -1000.0, 0.25], dtype=torch.bfloat16))
    assert scale.item() == 1.0
    assert q.float().isnan().tolist() == [False, True, False, False]
    assert q.float()[[0, 2, 3]].tolist() == [1.0, -448.0, 0.25]
    # An inf (no NaN) makes the scale inf: finite values become +-0, the infs NaN (inf / inf).
    q, scale = K.quantize_fp8(torch.tensor([1.0, float("inf"), -3.0, float("-inf")], dtype=torch.bfloat16))
    assert scale.item() == float("inf")
    assert q.float().isnan().tolist() == [False, True, False, True]
    assert q.view(torch.uint8)[[0, 2]].tolist() == [0x00, 0x80]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_dequantize_fp8_within_e4m3_precision(dtype):
    """|dequantize(quantize(x)) - x| <= (2^-4 + 2u)|x| + scale * 2^-10: e4m3 keeps 4 significant
    bits (half an ulp is 2^-4 relative) down to 2^-6, below which its subnormal step is 2^-9;
    u is the output dtype's unit roundoff."""
    u = torch.finfo(dtype).eps / 2
    for x in quantize_cases(dtype):
        q, scale = K.quantize_fp8(x)
        out = K.dequantize_fp8(q, scale, dtype)
        assert out.dtype == dtype and out.shape == x.shape
        xd, od = x.double(), out.double()
        bound = (2.0**-4 + 2 * u) * xd.abs() + scale.item() * 2.0**-10 * 1.001 + torch.finfo(dtype).smallest_normal
        assert bool(((od - xd).abs() <= bound).all()), dtype
        # Exactly dtype(value(q) * scale), the product rounded once to float32.
        codes = q.view(torch.uint8).long()
        v = E4M3_VALUES[(codes & 0x7F).clamp(max=126)] * torch.where(codes >= 0x80, -1.0, 1.0).double()
        assert torch.equal(out, (v * scale.item()).float().to(dtype))


# -- the embedded kernel image --------------------------------------------------------------------

FATBIN_MAGIC = 0xBA55ED50
FATBIN_KIND_PTX, FATBIN_KIND_ELF = 1, 2
FATBIN_FLAG_COMPRESSED = 0x2000


def kernel_image() -> bytes:
    c = load()
    if not hasattr(c, "kernels_image"):
        pytest.skip("binding not built yet: transport._C has no kernels_image()")
    image = c.kernels_image()
    if image is None:
        pytest.skip("built without nvcc: transport._C embeds no kernels")
    return image


def fatbin_entries(image: bytes) -> list[tuple[int, int, int, bytes]]:
    """(kind, arch, flags, payload) of each entry. The layout (not documented by NVIDIA, as
    read by cuobjdump and the open fatbin readers): a 16-byte header {u32 magic, u16 version,
    u16 header size, u64 size of the entries}, then entries {u16 kind, u16, u32 header size,
    u64 payload size, u32, u32, u16, u16, u32 arch, u32, u32, u64 flags, ...} + payload."""
    magic, version, header_size, fat_size = struct.unpack_from("<IHHQ", image, 0)
    assert magic == FATBIN_MAGIC, hex(magic)
    assert version == 1 and header_size == 16
    assert header_size + fat_size == len(image)
    entries, off = [], header_size
    while off < len(image):
        kind, _, entry_header, size = struct.unpack_from("<HHIQ", image, off)
        (arch,) = struct.unpack_from("<I", image, off + 28)
        (flags,) = struct.unpack_from("<Q", image, off + 40)
        entries.append((kind, arch, flags, image[off + entry_header : off + entry_header + size]))
        off += entry_header + size
    assert off == len(image)
    return entries


def elf_global_functions(elf: bytes) -> set[str]:
    """Names of the global function symbols in an ELF64 little-endian image (a cubin)."""
    assert elf[:4] == b"\x7fELF" and elf[4] == 2 and elf[5] == 1
    shoff, = struct.unpack_from("<Q", elf, 0x28)
    shentsize, shnum = struct.unpack_from("<HH", elf, 0x3A)
    sections = [struct.unpack_from("<IIQQQQIIQQ", elf, shoff + i * shentsize) for i in range(shnum)]
    names = set()
    for _, sh_type, _, _, offset, size, link, _, _, entsize in sections:
        if sh_type != 2:  # SHT_SYMTAB
            continue
        strtab = sections[link]
        for s in range(offset, offset + size, entsize):
            st_name, st_info = struct.unpack_from("<IB", elf, s)
            if st_info & 0xF == 2 and st_info >> 4 == 1:  # STT_FUNC, STB_GLOBAL
                start = strtab[4] + st_name
                names.add(elf[start : elf.index(b"\0", start)].decode())
    return names


def test_kernel_image_is_a_fatbin_with_every_kernel_for_every_arch():
    image = kernel_image()
    arches = load().kernels_arches().split(",")
    assert "sm_80" in arches and "sm_90" in arches, arches
    entries = fatbin_entries(image)
    found = {("sm" if kind == FATBIN_KIND_ELF else "compute") + f"_{arch}" for kind, arch, _, _ in entries}
    assert found == set(arches)
    for kind, arch, flags, payload in entries:
        if kind != FATBIN_KIND_ELF:
            continue
        assert not flags & FATBIN_FLAG_COMPRESSED, "the build asks nvcc for --compress-mode=none"
        assert elf_global_functions(payload) >= set(KERNEL_NAMES), f"sm_{arch}"


def find_cuobjdump() -> str | None:
    import importlib.util

    spec = importlib.util.find_spec("nvidia")  # the nvidia-cuda-cuobjdump wheel (dev extra)
    wheel = [
        os.path.join(p, sub, "bin", "cuobjdump")
        for p in (spec.submodule_search_locations or [])
        for sub in ("cu13", "cu12", "cuda_cuobjdump")
    ] if spec else []
    for candidate in (
        shutil.which("cuobjdump"),
        *wheel,
        os.path.join(os.environ.get("CUDA_HOME", "/nonexistent"), "bin", "cuobjdump"),
        "/usr/local/cuda/bin/cuobjdump",
    ):
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    return None


def test_cuobjdump_lists_every_kernel_for_sm80_and_sm90(tmp_path: Path):
    image = kernel_image()
    cuobjdump = find_cuobjdump()
    if cuobjdump is None:
        pytest.skip("cuobjdump not installed (CUDA toolkit or `pip install nvidia-cuda-cuobjdump`)")
    fatbin = tmp_path / "kernels.fatbin"
    fatbin.write_bytes(image)
    elves = subprocess.run([cuobjdump, "--list-elf", str(fatbin)], capture_output=True, text=True, check=True).stdout
    assert ".sm_80.cubin" in elves and ".sm_90.cubin" in elves, elves
    listing = subprocess.run([cuobjdump, "-symbols", str(fatbin)], capture_output=True, text=True, check=True).stdout
    per_arch = {}
    for block in listing.split("Fatbin elf code:")[1:]:
        arch = block.split("arch = ", 1)[1].split()[0]
        lines = block.splitlines()
        # Older cuobjdump: "STT_FUNC STB_GLOBAL STO_ENTRY name"; 13.5+: "FUNC GLOBAL DEFAULT ENTRY name".
        per_arch[arch] = {
            line.split()[-1] for line in lines
            if line.split()[:2] in (["STT_FUNC", "STB_GLOBAL"], ["FUNC", "GLOBAL"]) and "ENTRY" in line
        }
    for arch in ("sm_80", "sm_90"):
        assert per_arch.get(arch, set()) >= set(KERNEL_NAMES), (arch, listing)


# -- on a GPU: each kernel against its CPU reference ----------------------------------------------

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (none here)")


@pytest.fixture
def kernels():
    """The kernels loaded on GPU 0. A build that has them must load them (a failure is a bug
    or a driver older than the nvcc that compiled them), not fall back silently."""
    kernel_image()
    from transport import _cuda

    return _cuda.kernels(0)


def bits_equal_except_nan(a: torch.Tensor, b: torch.Tensor) -> None:
    """Equal bit patterns, except that NaNs need only be NaN on both sides (the kernels write
    canonical NaNs, torch keeps signs and payloads)."""
    a, b = a.cpu(), b.cpu()
    na, nb = a.float().isnan(), b.float().isnan()
    assert torch.equal(na, nb)
    ints = {1: torch.uint8, 2: torch.int16}[a.element_size()]
    assert torch.equal(a.view(ints)[~na], b.view(ints)[~nb])


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.gpu
@needs_gpu
@pytest.mark.usefixtures("kernels")
def test_gpu_batched_copy_matches_reference(seed):
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    src = torch.randint(0, 256, (3_000_017,), dtype=torch.uint8, generator=g)
    dst = torch.randint(0, 256, (4_000_037 + 2_500_000,), dtype=torch.uint8, generator=g)
    copies = random_copies(rng, src.numel(), 4_000_037, big=True)
    copies.append((4_000_037, 5, 2_500_000))  # several pieces, src and dst misaligned alike
    src_d, dst_d = src.cuda(), dst.cuda()
    K.batched_copy([(dst_d.data_ptr() + d, src_d.data_ptr() + s, n) for d, s, n in copies], src_d.device)
    K.batched_copy_reference([(dst.data_ptr() + d, src.data_ptr() + s, n) for d, s, n in copies])
    torch.cuda.synchronize()
    assert torch.equal(dst_d.cpu(), dst)


@pytest.mark.parametrize("seed", range(2))
@pytest.mark.gpu
@needs_gpu
@pytest.mark.usefixtures("kernels")
def test_gpu_pack_unpack_match_cpu(seed):
    rng = random.Random(seed)
    tensors = random_tensors(200 + seed, 400)
    offsets, size = odd_offsets(rng, tensors)
    bucket = torch.randint(0, 256, (size,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))
    bucket_d = bucket.cuda()
    K.pack(bucket, tensors, offsets)
    K.pack(bucket_d, [t.cuda() for t in tensors], offsets)
    assert torch.equal(bucket_d.cpu(), bucket)
    dsts = [torch.empty_like(t, device="cuda") for t in tensors]
    K.unpack(bucket_d, dsts, offsets, [t.dtype for t in tensors])
    for t, d in zip(tensors, dsts, strict=True):
        assert raw(d.cpu()) == raw(t)


def gpu_quantize_cases() -> list[torch.Tensor]:
    every_bf16 = torch.arange(1 << 16, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    cases = [*quantize_cases(torch.bfloat16), every_bf16, every_bf16[every_bf16.float().isfinite()]]
    cases.append(torch.tensor([1.0, float("inf"), -3.0, float("-inf")], dtype=torch.bfloat16))
    return cases


@pytest.mark.gpu
@needs_gpu
@pytest.mark.usefixtures("kernels")
def test_gpu_quantize_matches_reference():
    for x in gpu_quantize_cases():
        for lead in (0, 1, 3):  # element offsets 1 and 3 take the kernels' unvectorised path
            base = torch.zeros(x.numel() + lead, dtype=torch.bfloat16, device="cuda")
            xd = base[lead:].view(x.shape) if x.is_contiguous() else x.cuda()
            xd.copy_(x)
            q, scale = K.quantize_fp8(xd)
            rq, rscale = K.quantize_fp8(x)
            assert q.device == xd.device and scale.device == xd.device and q.shape == x.shape
            assert scale.item() == rscale.item()
            bits_equal_except_nan(q, rq)
            nan = q.float().isnan()
            assert bool((q.view(torch.uint8)[nan] == 0x7F).all())  # canonical NaN whatever the sign


@pytest.mark.gpu
@needs_gpu
@pytest.mark.usefixtures("kernels")
def test_gpu_dequantize_matches_reference():
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).repeat(41)[:10_007].view(FP8)
    for s in (1.0, 0.5, 3.0e-3, 7.1e36, 2.0 / 448, 1e-40):
        scale = torch.tensor(s, dtype=torch.float32)
        for lead in (0, 1):
            qd = torch.empty(codes.numel() + lead, dtype=torch.uint8, device="cuda")[lead:].view(FP8)
            qd.copy_(codes)
            out = K.dequantize_fp8(qd, scale.cuda(), torch.bfloat16)
            bits_equal_except_nan(out, K.dequantize_fp8(codes, scale, torch.bfloat16))


@pytest.mark.gpu
@needs_gpu
@pytest.mark.usefixtures("kernels")
def test_gpu_quantize_other_dtypes_runs_the_reference_on_the_device():
    for x in quantize_cases(torch.float16)[:6]:
        q, scale = K.quantize_fp8(x.cuda())
        rq, rscale = K.quantize_fp8(x)
        assert q.is_cuda and scale.item() == rscale.item()
        assert torch.equal(q.view(torch.uint8).cpu(), rq.view(torch.uint8))

