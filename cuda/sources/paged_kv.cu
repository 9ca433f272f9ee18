// Paged KV gather / scatter: an engine's paged KV cache <-> a contiguous staging buffer.
//
// Layout (one layer, K or V):
//   pages    [num_pages, page_size, row]      row = num_kv_heads * head_dim elements
//   table    [num_table]                      int32 page ids, in token order
//   staging  [num_tokens, row]                token t lives in page table[t / page_size],
//                                             slot t % page_size
// One thread per (token, element); elements are copied as raw 16-bit words so the same kernel
// serves float16 and bfloat16 (float32 rows are passed as twice as many 16-bit words).
// The CPU reference is kvstore.cuda.reference.gather_paged / scatter_paged.

extern "C" __global__ void gather_paged_kv(
    const unsigned short* __restrict__ pages,
    const int* __restrict__ table,
    unsigned short* __restrict__ staging,
    const long long num_tokens,
    const int page_size,
    const int row)
{
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    const long long total = num_tokens * row;
    if (i >= total) return;
    const long long t = i / row;
    const int e = (int)(i - t * row);
    const long long page = table[t / page_size];
    const long long slot = t % page_size;
    staging[i] = pages[(page * page_size + slot) * row + e];
}

extern "C" __global__ void scatter_paged_kv(
    const unsigned short* __restrict__ staging,
    const int* __restrict__ table,
    unsigned short* __restrict__ pages,
    const long long num_tokens,
    const int page_size,
    const int row)
{
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    const long long total = num_tokens * row;
    if (i >= total) return;
    const long long t = i / row;
    const int e = (int)(i - t * row);
    const long long page = table[t / page_size];
    const long long slot = t % page_size;
    pages[(page * page_size + slot) * row + e] = staging[i];
}
