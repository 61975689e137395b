/* dst[dst_rows[i]] = src[src_rows[i]] for rows of `row_bytes`: a KV transfer's scattered block copy.
 *
 * Why by hand: blocks of a request sit anywhere in a pool, so a transfer is many ~10 KB copies;
 * one memmove call per block from Python costs more than the copy itself, and one thread
 * reaches only part of the memory bandwidth. Rows are split over threads. */
#include <stdint.h>
#include <string.h>

void kvbaton_copy_rows(char *dst, const char *src, const int64_t *dst_rows, const int64_t *src_rows, int64_t n,
                       int64_t row_bytes, int num_threads) {
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t i = 0; i < n; i++) memcpy(dst + dst_rows[i] * row_bytes, src + src_rows[i] * row_bytes, row_bytes);
}
