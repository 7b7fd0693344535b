/* megakernel's C API: a decode engine behind a handle, for engines that embed it as a backend.
 *
 *   mk_options o;  mk_options_init(&o);  o.model = "tiny-moe";  o.max_len = 256;
 *   mk_engine *e;
 *   if (mk_open(&o, &e) != MK_OK) { fprintf(stderr, "%s\n", mk_last_error()); return 1; }
 *   int32_t next;
 *   mk_feed(e, prompt, prompt_len, &next);           // prefill: the next token after the prompt
 *   for (int i = 0; i < 16; i++) mk_feed(e, &next, 1, &next);   // decode, one token a call
 *   mk_close(e);
 *
 * Every call returns a status; on anything but MK_OK, mk_last_error() says what was wrong (which argument,
 * which limit) and the engine is as it was before the call.  Calls on one engine must not overlap; engines
 * may be used from any thread.
 *
 * This version runs the engine through an embedded CPython (the package must be importable by the Python
 * that megakernel.capi was built with, or by $MEGAKERNEL_PYTHON, a python executable of an environment that
 * has it).  The interface is the one a Python-free build (exported plans loaded through the CUDA driver API)
 * is to keep.  Build: python -m megakernel.capi build --out DIR.
 */
#ifndef MEGAKERNEL_H
#define MEGAKERNEL_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef enum mk_status {
    MK_OK = 0,
    MK_ERR_ARGUMENT = 1, /* a bad argument: a null pointer, an unknown model, a token outside the vocabulary */
    MK_ERR_CAPACITY = 2, /* the call needs more cache positions than mk_options.max_len */
    MK_ERR_RUNTIME = 3,  /* the engine failed (a kernel's error flag, a device error) */
    MK_ERR_PYTHON = 4    /* the embedded Python could not start or import megakernel */
} mk_status;

typedef struct mk_options {
    uint32_t struct_size; /* sizeof(mk_options), set by mk_options_init: later fields are appended */
    const char *model;    /* a preset (tiny-moe, llama-1b, dsv2-lite, ...) or an HF folder; NULL: the default */
    const char *backend;  /* "megakernel", "interpret" or "reference"; NULL: megakernel on CUDA, else interpret */
    const char *device;   /* "cuda", "cuda:1", "cpu"; NULL: cuda when there is one */
    const char *dtype;    /* "bfloat16", "float32", ...; NULL: the model's on CUDA, float32 on a CPU */
    int32_t max_len;      /* cache positions: prompt and generated tokens together (default 4096) */
    int32_t workers;      /* persistent workers; 0: one per SM on CUDA, 8 on a CPU */
    uint64_t seed;        /* seeded random weights when the model has no checkpoint */
    /* Appended in the second version (a caller built against the first passes the shorter struct_size and gets
     * these defaults): */
    float temperature;    /* 0 (default): the greedy next token; > 0: drawn from softmax(logits / temperature) */
    float top_p;          /* with temperature > 0: drawn from the smallest top set of this mass, in (0, 1]
                           * (default 1) */
    uint64_t sample_seed; /* a draw depends only on this seed's low 32 bits and the position, so a conversation
                           * fed again after mk_reset draws the same tokens (default 0) */
} mk_options;

typedef struct mk_engine mk_engine;

void mk_options_init(mk_options *options);

/* Loads the model and compiles (on CUDA: captures) its decode step. */
mk_status mk_open(const mk_options *options, mk_engine **engine);

/* Appends n >= 1 tokens at the engine's position (a prompt in chunks, or one decoded token) and writes the
 * next token to *next_token (may be NULL): the greedy one, or one sampled at mk_options.temperature. */
mk_status mk_feed(mk_engine *engine, const int32_t *tokens, size_t n, int32_t *next_token);

/* The last fed position's logits (float32, mk_vocab_size of them) into logits[0..capacity). */
mk_status mk_logits(mk_engine *engine, float *logits, size_t capacity);

/* Back to position 0 (a new conversation), keeping the compiled engine. */
mk_status mk_reset(mk_engine *engine);

int32_t mk_vocab_size(const mk_engine *engine); /* -1 for NULL */
int32_t mk_position(const mk_engine *engine);   /* tokens fed since open or reset; -1 for NULL */

/* Frees the engine (NULL is fine). */
void mk_close(mk_engine *engine);

/* The message of this thread's last failed call ("" if none); valid until this thread's next call. */
const char *mk_last_error(void);

#ifdef __cplusplus
}
#endif
#endif
