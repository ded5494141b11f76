/* vx_spend: what one priced answer costs and the ledger row's bytes, without Python.
 *
 * Why: a worker with spend on priced each answer, counted it for /metrics and appended its
 * ledger row in ~15 Python-level steps of < 0.3 us each (~6 us a request end to end); the
 * binding (bind_spend.c) does them in one call, with this arithmetic.
 *
 * Money is integers, as velox.spend.prices states: a price is pico-USD per token
 * (micro-USD per million), a cost is rounded once, half up, to nano-USD.
 */
#ifndef VX_SPEND_H
#define VX_SPEND_H

#include <stddef.h>
#include <stdint.h>

/* A price record's fields by position (velox.spend.wire.PRICE_FIELDS states the same order;
 * a test compares them). A part priced at its parent's price (cached input, cache writes at
 * the input's, reasoning at the output's) is -1. */
enum vx_spend_price {
    VX_PRICE_INPUT,
    VX_PRICE_OUTPUT,
    VX_PRICE_CACHED_INPUT,
    VX_PRICE_CACHE_WRITE,
    VX_PRICE_REASONING,
    VX_PRICE_REQUEST, /* nano-USD per request */
    VX_PRICE_FIELDS
};

/* A usage: input and output tokens, then the parts of them (velox.spend.prices.UsageLike). */
enum vx_spend_usage {
    VX_USAGE_INPUT,
    VX_USAGE_OUTPUT,
    VX_USAGE_CACHED,
    VX_USAGE_WRITTEN,
    VX_USAGE_REASONING,
    VX_USAGE_FIELDS
};

/* The cost in nano-USD of `usage` at `price` (velox.spend.prices.cost_nanos with no images:
 * negative counts read as 0, each part capped at what is left of its parent). 0 with *nanos
 * set; -1 when a product or sum does not fit 64 bits (the caller prices it in Python). */
int vx_spend_cost(const int64_t price[VX_PRICE_FIELDS], const int64_t usage[VX_USAGE_FIELDS],
                  int64_t *nanos);

/* The ledger's request id of an x-request-id value: its first `chars` bytes read as latin-1
 * (each byte one code point), written as UTF-8 with NUL as U+FFFD (the frame separates ids by
 * NUL). Needs 3 * min(n, chars) bytes at out; returns the bytes written. */
#define VX_SPEND_ID_CHARS 128
size_t vx_spend_id(char *out, const unsigned char *s, size_t n, size_t chars);

#endif /* VX_SPEND_H */
