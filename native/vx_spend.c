/* vx_spend: see vx_spend.h. */
#include "vx_spend.h"

#define PICO_PER_NANO 1000

static int64_t nonneg(int64_t v)
{
    return v > 0 ? v : 0;
}

static int64_t at_most(int64_t v, int64_t cap)
{
    return v < cap ? v : cap;
}

/* *acc += tokens * price; 0, or -1 on overflow. */
static int add_product(int64_t *acc, int64_t tokens, int64_t price)
{
    int64_t p;
    if (__builtin_mul_overflow(tokens, price, &p) || __builtin_add_overflow(*acc, p, acc))
        return -1;
    return 0;
}

int vx_spend_cost(const int64_t price[VX_PRICE_FIELDS], const int64_t usage[VX_USAGE_FIELDS],
                  int64_t *nanos)
{
    int64_t total_in = nonneg(usage[VX_USAGE_INPUT]);
    int64_t cached = at_most(nonneg(usage[VX_USAGE_CACHED]), total_in);
    int64_t written = at_most(nonneg(usage[VX_USAGE_WRITTEN]), total_in - cached);
    int64_t total_out = nonneg(usage[VX_USAGE_OUTPUT]);
    int64_t reasoning = at_most(nonneg(usage[VX_USAGE_REASONING]), total_out);
    int64_t in = price[VX_PRICE_INPUT], out = price[VX_PRICE_OUTPUT];
    int64_t cached_price = price[VX_PRICE_CACHED_INPUT] < 0 ? in : price[VX_PRICE_CACHED_INPUT];
    int64_t write_price = price[VX_PRICE_CACHE_WRITE] < 0 ? in : price[VX_PRICE_CACHE_WRITE];
    int64_t reason_price = price[VX_PRICE_REASONING] < 0 ? out : price[VX_PRICE_REASONING];
    int64_t pico = 0;
    if (add_product(&pico, total_in - cached - written, in) < 0 ||
        add_product(&pico, cached, cached_price) < 0 ||
        add_product(&pico, written, write_price) < 0 ||
        add_product(&pico, total_out - reasoning, out) < 0 ||
        add_product(&pico, reasoning, reason_price) < 0 ||
        __builtin_add_overflow(pico, PICO_PER_NANO / 2, &pico))
        return -1;
    /* pico >= 0 (prices are never negative: the configuration refuses them), so C's division
     * is Python's floor division here. */
    int64_t cost = pico / PICO_PER_NANO;
    if (pico < 0 || __builtin_add_overflow(cost, price[VX_PRICE_REQUEST], &cost))
        return -1;
    *nanos = cost;
    return 0;
}

size_t vx_spend_id(char *out, const unsigned char *s, size_t n, size_t chars)
{
    char *p = out;
    if (n > chars)
        n = chars;
    for (size_t i = 0; i < n; i++) {
        unsigned char c = s[i];
        if (c == 0) { /* U+FFFD */
            *p++ = (char)0xEF;
            *p++ = (char)0xBF;
            *p++ = (char)0xBD;
        } else if (c < 0x80) {
            *p++ = (char)c;
        } else {
            *p++ = (char)(0xC0 | (c >> 6));
            *p++ = (char)(0x80 | (c & 0x3F));
        }
    }
    return (size_t)(p - out);
}
