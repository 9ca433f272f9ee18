// FP8 (E4M3, "fn": no infinities, max 448) quantise / dequantise with one scale per head.
//
//   x      [num_tokens, num_heads, head_dim]   float (float32) input
//   scale  [num_heads]                         float32, > 0
//   q      [num_tokens, num_heads, head_dim]   uint8 E4M3 bit patterns
// quantise:   q = e4m3(clamp(x / scale[h], -448, 448))   round to nearest even, saturating
// dequantise: y = float(q) * scale[h]
// The division (not a multiply by 1/scale) matches the CPU reference bit for bit for finite
// inputs (a NaN input saturates here but stays NaN in torch; KV never holds NaN):
// kvstore.cuda.reference.quantize_e4m3 / dequantize_e4m3.

#include <cuda_fp8.h>

extern "C" __global__ void quantize_e4m3(
    const float* __restrict__ x,
    const float* __restrict__ scale,
    unsigned char* __restrict__ q,
    const long long n,
    const int num_heads,
    const int head_dim)
{
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    const int h = (int)((i / head_dim) % num_heads);
    float v = x[i] / scale[h];
    v = fminf(fmaxf(v, -448.0f), 448.0f);
    q[i] = (unsigned char)__nv_cvt_float_to_fp8(v, __NV_SATFINITE, __NV_E4M3);
}

extern "C" __global__ void dequantize_e4m3(
    const unsigned char* __restrict__ q,
    const float* __restrict__ scale,
    float* __restrict__ y,
    const long long n,
    const int num_heads,
    const int head_dim)
{
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    const int h = (int)((i / head_dim) % num_heads);
    __half_raw r = __nv_cvt_fp8_to_halfraw((__nv_fp8_storage_t)q[i], __NV_E4M3);
    y[i] = __half2float(__half(r)) * scale[h];
}
