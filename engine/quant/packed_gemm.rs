//! MKL's packed-operand GEMM (`cblas_sgemm_pack` / `cblas_sgemm_compute`), found at run time
//! in the libtorch the engine is linked with, for the tiles of [`super::matrix`]'s GEMM path.
//!
//! That path multiplies the same activations `x` (`[n, cols]`) by every tile of a weight
//! matrix. Given a tile at a time, MKL takes its no-copy kernel for these shapes and re-reads
//! `x` from its row-major layout for every tile; packed once into MKL's own layout, `x` feeds
//! each tile's product directly: 12–20% more GFLOP/s on the encoder's shapes on a Cascade Lake
//! core (BENCHMARKS.md §9.25). The packing is done once per product on the calling thread; the
//! tiles' products read it from every compute thread (it is never written after packing).
//!
//! libtorch builds for x86_64 link MKL and export these symbols; aarch64 builds (OpenBLAS or
//! libtorch's own kernels) do not, and there [`PackedActs::pack`] returns `None` and the tiles
//! go through libtorch's `mm` as before (as they do with `EDGEMOE_MKL_PACK=off`). The symbols
//! are looked up once with `dlsym`, so the binary links the same either way.

use std::ffi::{c_void, CStr};
use std::sync::OnceLock;

use memmap2::MmapMut;

/// MKL's CBLAS enums (`mkl_cblas.h`).
const ROW_MAJOR: i32 = 101;
const TRANS: i32 = 112;
const NO_TRANS: i32 = 111;
const A_MATRIX: i32 = 161;
const PACKED: i32 = 151;

type PackGetSize = unsafe extern "C" fn(identifier: i32, m: i32, n: i32, k: i32) -> usize;
type Pack = unsafe extern "C" fn(
    layout: i32,
    identifier: i32,
    trans: i32,
    m: i32,
    n: i32,
    k: i32,
    alpha: f32,
    src: *const f32,
    ld: i32,
    dest: *mut f32,
);
type Compute = unsafe extern "C" fn(
    layout: i32,
    transa: i32,
    transb: i32,
    m: i32,
    n: i32,
    k: i32,
    a: *const f32,
    lda: i32,
    b: *const f32,
    ldb: i32,
    beta: f32,
    c: *mut f32,
    ldc: i32,
);

struct Api {
    get_size: PackGetSize,
    pack: Pack,
    compute: Compute,
}

/// The three functions, where the process has them (`EDGEMOE_MKL_PACK=off` turns them off,
/// for A/B runs against libtorch's `mm`).
fn api() -> Option<&'static Api> {
    static API: OnceLock<Option<Api>> = OnceLock::new();
    API.get_or_init(|| {
        if std::env::var_os("EDGEMOE_MKL_PACK").is_some_and(|v| v == "off") {
            return None;
        }
        let find = |name: &CStr| {
            // SAFETY: `dlsym` with RTLD_DEFAULT and a NUL-terminated name only looks the
            // symbol up in the loaded objects.
            let at = unsafe { libc::dlsym(libc::RTLD_DEFAULT, name.as_ptr()) };
            (!at.is_null()).then_some(at)
        };
        let (get_size, pack, compute) = (
            find(c"cblas_sgemm_pack_get_size")?,
            find(c"cblas_sgemm_pack")?,
            find(c"cblas_sgemm_compute")?,
        );
        // SAFETY: these are MKL's functions of these names, whose C signatures the types
        // above spell (mkl_cblas.h, MKL_INT being 32-bit in the LP64 interface libtorch uses).
        unsafe {
            Some(Api {
                get_size: std::mem::transmute::<*mut c_void, PackGetSize>(get_size),
                pack: std::mem::transmute::<*mut c_void, Pack>(pack),
                compute: std::mem::transmute::<*mut c_void, Compute>(compute),
            })
        }
    })
    .as_ref()
}

/// Resident bytes [`PackedActs::pack`] keeps for `n` activation rows of `cols` values (0 where
/// MKL's packed GEMM is not available): what MKL writes of its packed layout, measured at the
/// activations' own size plus up to 1% (padding to its kernel's panels), with 1/8 and a few
/// pages to spare; never more than MKL's whole size (see [`PackBuffer`]).
pub fn packed_acts_bytes(n: usize, cols: usize, tile_rows: usize) -> u64 {
    let (Some(api), Ok(m), Ok(k), Ok(tile_rows)) = (
        api(),
        i32::try_from(n),
        i32::try_from(cols),
        i32::try_from(tile_rows),
    ) else {
        return 0;
    };
    // SAFETY: plain size query.
    let size = unsafe { (api.get_size)(A_MATRIX, m, tile_rows, k) } as u64;
    let written = (n as u64).saturating_mul(cols as u64).saturating_mul(4);
    size.min(written.saturating_add(written / 8).saturating_add(64 << 10))
}

/// Where [`PackedActs::pack`] packs: an anonymous mapping, grown to the largest size MKL has
/// asked for and reused. MKL's size includes a workspace it leaves untouched in these
/// products (9 MiB asked for 353 × 768 activations, of which it writes 1.04 MiB; 13.8 MiB
/// for 353 × 3072, 4.16 written), and a mapping's pages become resident only once written,
/// so the process holds about the activations' own size ([`packed_acts_bytes`]).
pub struct PackBuffer(Option<MmapMut>);

impl PackBuffer {
    pub const fn new() -> Self {
        PackBuffer(None)
    }
}

/// Activations `x` (`[n, cols]`, row-major) packed as the `A` operand of `x · Wᵀ` for weight
/// tiles of up to `tile_rows` rows.
pub struct PackedActs<'a> {
    packed: &'a [u8],
    n: i32,
    cols: i32,
}

impl<'a> PackedActs<'a> {
    /// Packs `x`, or `None` where MKL's packed GEMM is not available or a dimension (`rows`:
    /// the whole matrix's, the stride of the products) exceeds MKL's 32-bit sizes.
    /// `buffer` is the caller's to reuse across products.
    pub fn pack(
        buffer: &'a mut PackBuffer,
        x: &[f32],
        n: usize,
        cols: usize,
        tile_rows: usize,
        rows: usize,
    ) -> Option<PackedActs<'a>> {
        let api = api()?;
        i32::try_from(rows).ok()?;
        let (n, cols, tile_rows) = (
            i32::try_from(n).ok()?,
            i32::try_from(cols).ok()?,
            i32::try_from(tile_rows).ok()?,
        );
        assert!(
            x.len() >= n as usize * cols as usize,
            "packed GEMM: x too short"
        );
        // SAFETY: plain size query.
        let size = unsafe { (api.get_size)(A_MATRIX, n, tile_rows, cols) };
        if buffer.0.as_ref().is_none_or(|map| map.len() < size) {
            // Page-aligned; a failed mapping leaves the product to libtorch's `mm`.
            let map = MmapMut::map_anon(size).ok()?;
            // Small pages, so that what stays resident is what MKL writes even where
            // transparent huge pages are on for every mapping.
            #[cfg(target_os = "linux")]
            let _ = map.advise(memmap2::Advice::NoHugePage);
            buffer.0 = Some(map);
        }
        let map = buffer.0.as_mut()?;
        // SAFETY: `x` holds `n × cols` values with row stride `cols`; the destination has the
        // size MKL asked for, aligned.
        unsafe {
            (api.pack)(
                ROW_MAJOR,
                A_MATRIX,
                NO_TRANS,
                n,
                tile_rows,
                cols,
                1.0,
                x.as_ptr(),
                cols,
                map.as_mut_ptr().cast(),
            )
        };
        Some(PackedActs {
            packed: &map[..size],
            n,
            cols,
        })
    }

    /// `out[i, j] = Σ_c x[i, c] · tile[j, c]` for `tile` `[tile.len() / cols, cols]`, written
    /// at `out[i * out_stride + j]`.
    ///
    /// # Safety
    /// `out` must be valid for writes of `n` rows of `tile.len() / cols` values at stride
    /// `out_stride` (at most the `rows` packed for), and no other thread may touch those
    /// values meanwhile.
    pub unsafe fn multiply(&self, tile: &[f32], out: *mut f32, out_stride: usize) {
        let api = api().expect("packed activations exist only where the API does");
        let tile_rows = tile.len() / self.cols as usize;
        // SAFETY: the packed bytes stay where they were packed (borrowed); `tile` is
        // `[tile_rows, cols]`; `out` as the caller promises.
        unsafe {
            (api.compute)(
                ROW_MAJOR,
                PACKED,
                TRANS,
                self.n,
                tile_rows as i32,
                self.cols,
                self.packed.as_ptr().cast(),
                self.cols,
                tile.as_ptr(),
                self.cols,
                0.0,
                out,
                out_stride as i32,
            )
        }
    }
}
