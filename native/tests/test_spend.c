/* vx_spend: a cost's arithmetic (rounding, parts capped, parents' prices, overflow refused)
 * and the ledger's request id (latin-1 to UTF-8, NUL replaced, cut at its length). */
#include "vx_spend.h"

#include "tests/check.h"

#include <string.h>

static void test_cost(void)
{
    /* gpt-4o-mini's list price: $0.15 / $0.60 per million tokens, cached input $0.075. */
    const int64_t mini[VX_PRICE_FIELDS] = {150000, 600000, 75000, -1, -1, 0};
    int64_t usage[VX_USAGE_FIELDS] = {1000, 200, 0, 0, 0}, nanos = -1;
    CHECK(vx_spend_cost(mini, usage, &nanos) == 0 && nanos == 270000);
    usage[VX_USAGE_CACHED] = 400; /* 600 at the input's price, 400 at the cached one */
    CHECK(vx_spend_cost(mini, usage, &nanos) == 0 && nanos == (600 * 150000 + 400 * 75000 +
                                                                200 * 600000 + 500) / 1000);
    usage[VX_USAGE_CACHED] = 5000; /* capped at the input */
    CHECK(vx_spend_cost(mini, usage, &nanos) == 0 && nanos == (1000 * 75000 + 200 * 600000 +
                                                                500) / 1000);
    usage[VX_USAGE_CACHED] = 0;
    usage[VX_USAGE_WRITTEN] = 100; /* a cache write without a price of its own: the input's */
    usage[VX_USAGE_REASONING] = 300; /* capped at the output, billed at the output's */
    CHECK(vx_spend_cost(mini, usage, &nanos) == 0 && nanos == 270000);
    const int64_t apart[VX_PRICE_FIELDS] = {1000, 2000, 100, 3000, 4000, 7};
    int64_t parts[VX_USAGE_FIELDS] = {10, 20, 3, 4, 5};
    CHECK(vx_spend_cost(apart, parts, &nanos) == 0 &&
          nanos == (3 * 1000 + 3 * 100 + 4 * 3000 + 15 * 2000 + 5 * 4000 + 500) / 1000 + 7);
    int64_t negative[VX_USAGE_FIELDS] = {-5, -1, -3, -2, -9};
    CHECK(vx_spend_cost(apart, negative, &nanos) == 0 && nanos == 7);
    /* Half a nano-USD rounds up, less rounds down. */
    const int64_t half[VX_PRICE_FIELDS] = {500, 0, -1, -1, -1, 0};
    int64_t one[VX_USAGE_FIELDS] = {1, 0, 0, 0, 0};
    CHECK(vx_spend_cost(half, one, &nanos) == 0 && nanos == 1);
    const int64_t less[VX_PRICE_FIELDS] = {499, 0, -1, -1, -1, 0};
    CHECK(vx_spend_cost(less, one, &nanos) == 0 && nanos == 0);
    /* Past 64 bits: refused, *nanos untouched. */
    const int64_t dear[VX_PRICE_FIELDS] = {INT64_C(1) << 40, 0, -1, -1, -1, 0};
    int64_t many[VX_USAGE_FIELDS] = {INT64_C(1) << 30, 0, 0, 0, 0};
    nanos = 42;
    CHECK(vx_spend_cost(dear, many, &nanos) == -1 && nanos == 42);
    const int64_t fee[VX_PRICE_FIELDS] = {0, 0, -1, -1, -1, INT64_MAX};
    int64_t some[VX_USAGE_FIELDS] = {0, 0, 0, 0, 0};
    CHECK(vx_spend_cost(fee, some, &nanos) == 0 && nanos == INT64_MAX);
    const int64_t fee_and_input[VX_PRICE_FIELDS] = {1000, 0, -1, -1, -1, INT64_MAX};
    CHECK(vx_spend_cost(fee_and_input, one, &nanos) == -1);
}

static void test_request_id(void)
{
    char out[3 * VX_SPEND_ID_CHARS];
    const unsigned char id[] = {'a', 0xe9, 0x00, 'b', 0x80};
    size_t n = vx_spend_id(out, id, sizeof id, VX_SPEND_ID_CHARS);
    CHECK(n == 9 && memcmp(out, "a\xc3\xa9\xef\xbf\xbd" "b\xc2\x80", 9) == 0);
    unsigned char long_id[300];
    memset(long_id, 0xff, sizeof long_id);
    n = vx_spend_id(out, long_id, sizeof long_id, VX_SPEND_ID_CHARS);
    CHECK(n == 2 * VX_SPEND_ID_CHARS);
    CHECK(vx_spend_id(out, id, 0, VX_SPEND_ID_CHARS) == 0);
}

int main(void)
{
    test_cost();
    test_request_id();
    if (failures)
        fprintf(stderr, "test_spend: %d failure(s)\n", failures);
    return failures != 0;
}
