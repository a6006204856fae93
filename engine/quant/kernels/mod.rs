//! Dequantization kernels, one file per instruction set: the [`scalar`] reference, AVX2 on
//! x86_64 and NEON on aarch64. Each turns packed rows into f32 (`q × scale`, one multiplication,
//! no fused multiply-add) so that all kernels agree bit for bit.

#[cfg(target_arch = "x86_64")]
pub(crate) mod avx2;
#[cfg(target_arch = "aarch64")]
pub(crate) mod neon;
pub(crate) mod scalar;
