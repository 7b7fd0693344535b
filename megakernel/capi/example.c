/* A C program decoding through megakernel.h: greedy tokens after a prompt, printed one line.
 *   example [MODEL] [DEVICE] [MAX_LEN] [STEPS] [PROMPT TOKEN ...]
 * Prints the first logits' argmax beside mk_feed's token, "tokens: t1 t2 ...", the position, and the prompt's
 * next token again after mk_reset; or the failed call's status and message (exit status 10 + the status). */
#include <stdio.h>
#include <stdlib.h>

#include "megakernel.h"

static int check(mk_status status, const char *what) {
    if (status == MK_OK) return 0;
    fprintf(stderr, "%s failed (status %d): %s\n", what, (int)status, mk_last_error());
    return (int)status + 10;
}

int main(int argc, char **argv) {
    mk_options options;
    mk_options_init(&options);
    options.model = argc > 1 && argv[1][0] ? argv[1] : NULL;
    options.device = argc > 2 && argv[2][0] ? argv[2] : NULL;
    options.max_len = argc > 3 ? atoi(argv[3]) : 64;
    int steps = argc > 4 ? atoi(argv[4]) : 8;
    int prompt_len = argc > 5 ? argc - 5 : 1;
    int32_t *prompt = calloc((size_t)prompt_len, sizeof *prompt);
    for (int i = 0; i < prompt_len && argc > 5; i++) prompt[i] = atoi(argv[5 + i]);

    mk_engine *engine = NULL;
    int rc = check(mk_open(&options, &engine), "mk_open");
    int32_t next = -1;
    if (!rc) rc = check(mk_feed(engine, prompt, (size_t)prompt_len, &next), "mk_feed (prompt)");
    if (!rc) { /* the logits agree with the token mk_feed chose */
        int32_t vocab = mk_vocab_size(engine);
        float *logits = malloc((size_t)vocab * sizeof *logits);
        rc = check(mk_logits(engine, logits, (size_t)vocab), "mk_logits");
        int32_t best = 0;
        for (int32_t v = 1; !rc && v < vocab; v++) if (logits[v] > logits[best]) best = v;
        printf("vocab %d, argmax of the prompt's logits %d (mk_feed: %d)\n", vocab, best, next);
        free(logits);
    }
    if (!rc) printf("tokens:");
    for (int i = 0; !rc && i < steps; i++) {
        printf(" %d", next);
        if (i + 1 < steps) rc = check(mk_feed(engine, &next, 1, &next), "mk_feed (decode)");
    }
    if (!rc) printf("\nposition %d\n", mk_position(engine));
    if (!rc) rc = check(mk_reset(engine), "mk_reset");
    if (!rc) rc = check(mk_feed(engine, prompt, (size_t)prompt_len, &next), "mk_feed (after mk_reset)");
    if (!rc) printf("after reset: position %d, next %d\n", mk_position(engine), next);
    mk_close(engine);
    free(prompt);
    return rc;
}
