/* Per-thread scratch memory for the C kernels, kept from one call to the next.
 *
 * Why: a decoding step calls the kernels dozens of times a token, each wanting a few KB (an
 * input row's int16 grid, a head's scores). Taken from malloc and given back on every call,
 * that memory was measured to slow the product's stream itself, not just the call: the heap
 * hands back fresh (or freshly trimmed) pages in turn. Here each thread keeps one 64-byte
 * aligned buffer, grown when a call needs more and freed when the thread ends; requests over
 * HF_SCRATCH_KEEP bytes (long prompts, whose work dwarfs an allocation) still go to malloc.
 * hf_take gives the memory (NULL when there is none), hf_give returns what hf_take gave.
 */
#ifndef HF_SCRATCH_H
#define HF_SCRATCH_H

#include <pthread.h>
#include <stdlib.h>

#define HF_SCRATCH_KEEP ((size_t)1 << 20)

static pthread_key_t hf_scratch_key;
static pthread_once_t hf_scratch_once = PTHREAD_ONCE_INIT;
static __thread void *hf_scratch_mem;
static __thread size_t hf_scratch_size;

static void hf_scratch_init(void) { pthread_key_create(&hf_scratch_key, free); }

static void *hf_take(size_t bytes) {
    if (bytes > HF_SCRATCH_KEEP) return malloc(bytes);
    if (bytes > hf_scratch_size || hf_scratch_mem == NULL) {
        size_t size = (bytes + 4095) & ~(size_t)4095;
        void *mem = aligned_alloc(64, size);
        if (mem == NULL) return NULL;
        pthread_once(&hf_scratch_once, hf_scratch_init);
        free(hf_scratch_mem);
        hf_scratch_mem = mem;
        hf_scratch_size = size;
        pthread_setspecific(hf_scratch_key, mem); /* freed with the thread */
    }
    return hf_scratch_mem;
}

static void hf_give(void *mem) {
    if (mem != hf_scratch_mem) free(mem);
}

#endif
