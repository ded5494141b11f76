/* test_hpack.c: the HPACK decoder against RFC 7541 Appendix C.6 (Huffman, evictions in a
 * 256-octet table), Huffman round trips of every octet, the stateless encoder, and hostile
 * blocks: each must be refused with the right code and without reading out of bounds (this
 * program also runs under ASan + UBSan). */
#include "check.h"
#include "vx_hpack.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static size_t unhex(const char *hex, uint8_t *out)
{
    size_t n = 0;
    for (; hex[0] && hex[1]; hex += 2) {
        unsigned v;
        sscanf(hex, "%2x", &v);
        out[n++] = (uint8_t)v;
    }
    return n;
}

typedef struct {
    vx_hpack_decoder d;
    vx_buf arena;
    vx_hfields fields;
} ctx;

static void ctx_init(ctx *c, size_t table, size_t max_list)
{
    memset(c, 0, sizeof *c);
    CHECK(vx_hpack_decoder_init(&c->d, table, max_list));
}

static void ctx_free(ctx *c)
{
    vx_hpack_decoder_free(&c->d);
    vx_buf_free(&c->arena);
    free(c->fields.p);
}

static int decode(ctx *c, const uint8_t *in, size_t n)
{
    c->arena.len = 0;
    c->fields.len = 0;
    return vx_hpack_decode(&c->d, in, n, &c->arena, &c->fields);
}

static int decode_hex(ctx *c, const char *hex)
{
    uint8_t buf[1024];
    size_t n = unhex(hex, buf);
    return decode(c, buf, n);
}

static int field_is(ctx *c, size_t i, const char *name, const char *value)
{
    if (i >= c->fields.len)
        return 0;
    vx_hfield f = c->fields.p[i];
    return f.name_len == strlen(name) && memcmp(c->arena.p + f.name_off, name, f.name_len) == 0 &&
           f.value_len == strlen(value) && memcmp(c->arena.p + f.value_off, value, f.value_len) == 0;
}

static void test_rfc7541_c6(void)
{
    ctx c;
    ctx_init(&c, 256, 65536);
    CHECK(decode_hex(&c, "488264025885aec3771a4b6196d07abe941054d444a8200595040b8166e082a62d1bff"
                         "6e919d29ad171863c78f0b97c8e9ae82ae43d3") == VX_HPACK_OK);
    CHECK(c.fields.len == 4);
    CHECK(field_is(&c, 0, ":status", "302"));
    CHECK(field_is(&c, 1, "cache-control", "private"));
    CHECK(field_is(&c, 2, "date", "Mon, 21 Oct 2013 20:13:21 GMT"));
    CHECK(field_is(&c, 3, "location", "https://www.example.com"));
    CHECK(c.d.size == 222 && c.d.count == 4);
    CHECK(decode_hex(&c, "4883640effc1c0bf") == VX_HPACK_OK); /* evicts :status 302 */
    CHECK(field_is(&c, 0, ":status", "307"));
    CHECK(field_is(&c, 3, "location", "https://www.example.com"));
    CHECK(c.d.size == 222 && c.d.count == 4);
    CHECK(decode_hex(&c, "88c16196d07abe941054d444a8200595040b8166e084a62d1bffc05a839bd9ab77ad94e7"
                         "821dd7f2e6c7b335dfdfcd5b3960d5af27087f3672c1ab270fb5291f9587316065c003"
                         "ed4ee5b1063d5007") == VX_HPACK_OK);
    CHECK(c.fields.len == 6);
    CHECK(field_is(&c, 0, ":status", "200"));
    CHECK(field_is(&c, 2, "date", "Mon, 21 Oct 2013 20:13:22 GMT"));
    CHECK(field_is(&c, 4, "content-encoding", "gzip"));
    CHECK(field_is(&c, 5, "set-cookie", "foo=ASDJKHQKBZXOQWEOPIUAXQWEOIU; max-age=3600; version=1"));
    CHECK(c.d.size == 215 && c.d.count == 3);
    ctx_free(&c);
}

static void test_huffman_round_trip(void)
{
    uint8_t all[256];
    for (int i = 0; i < 256; i++)
        all[i] = (uint8_t)i;
    for (size_t n = 0; n <= 256; n++) {
        vx_buf enc = {0}, dec = {0};
        CHECK(vx_huffman_encode(all + (256 - n), n, &enc));
        CHECK(vx_huffman_decode(enc.p, enc.len, &dec) == VX_HPACK_OK);
        CHECK(dec.len == n && (n == 0 || memcmp(dec.p, all + (256 - n), n) == 0));
        vx_buf_free(&enc);
        vx_buf_free(&dec);
    }
}

static void test_huffman_hostile(void)
{
    vx_buf out = {0};
    /* 30 one-bits and more: EOS inside the string. */
    uint8_t eos[4] = {0xFF, 0xFF, 0xFF, 0xFF};
    CHECK(vx_huffman_decode(eos, 4, &out) == VX_HPACK_ERROR);
    /* 'a' is 00011 (5 bits); 0x1F = 00011 111: valid 3-bit padding. */
    uint8_t ok[1] = {0x1F};
    out.len = 0;
    CHECK(vx_huffman_decode(ok, 1, &out) == VX_HPACK_OK && out.len == 1 && out.p[0] == 'a');
    /* 00011 110: padding not all ones. */
    uint8_t badpad[1] = {0x1E};
    out.len = 0;
    CHECK(vx_huffman_decode(badpad, 1, &out) == VX_HPACK_ERROR);
    /* 'a' then a whole octet of ones: 11 bits of padding. */
    uint8_t longpad[2] = {0x1F, 0xFF};
    out.len = 0;
    CHECK(vx_huffman_decode(longpad, 2, &out) == VX_HPACK_ERROR);
    vx_buf_free(&out);
}

static void test_hostile_blocks(void)
{
    ctx c;
    ctx_init(&c, 4096, 65536);
    CHECK(decode_hex(&c, "80") == VX_HPACK_ERROR);           /* index 0 */
    CHECK(decode_hex(&c, "be") == VX_HPACK_ERROR);           /* index 62: empty dynamic table */
    CHECK(decode_hex(&c, "ff80808080808001") == VX_HPACK_ERROR); /* varint over 5 octets */
    CHECK(decode_hex(&c, "ffffffffff0f") == VX_HPACK_ERROR);  /* huge index, 5 octets */
    CHECK(decode_hex(&c, "ff") == VX_HPACK_ERROR);           /* truncated varint */
    CHECK(decode_hex(&c, "04") == VX_HPACK_ERROR);           /* truncated literal (no value) */
    CHECK(decode_hex(&c, "0f1005616263") == VX_HPACK_ERROR); /* value longer than the block */
    CHECK(decode_hex(&c, "007f") == VX_HPACK_ERROR);         /* name length past the end */
    CHECK(decode_hex(&c, "883f") == VX_HPACK_ERROR);         /* size update after a field */
    CHECK(decode_hex(&c, "3fe21f") == VX_HPACK_ERROR);       /* size update to 4097 > allowed */
    CHECK(decode_hex(&c, "3fe11f88") == VX_HPACK_OK);        /* size update to 4096 */
    CHECK(decode_hex(&c, "2020") == VX_HPACK_OK && c.fields.len == 0); /* two updates: legal */
    /* Now the table is 0: an incremental-indexing literal is decoded but not stored. */
    CHECK(decode_hex(&c, "400161016200") == VX_HPACK_ERROR); /* truncated after the pair */
    CHECK(decode_hex(&c, "4001610162") == VX_HPACK_OK && c.d.count == 0);
    CHECK(decode_hex(&c, "be") == VX_HPACK_ERROR);
    CHECK(decode_hex(&c, "0081ff0161") == VX_HPACK_ERROR);   /* bad Huffman name (EOS) */
    CHECK(decode_hex(&c, "00000161") == VX_HPACK_OK && c.fields.len == 1); /* empty name: HPACK allows it */
    ctx_free(&c);

    /* Header list limit: 100 + 32 per field accounted; 3 fields of 1+1+32 = 102 > 100. */
    ctx_init(&c, 4096, 100);
    CHECK(decode_hex(&c, "0001610162000161016200016101620001610162") == VX_HPACK_TOO_LARGE);
    CHECK(decode_hex(&c, "00016101620001610162") == VX_HPACK_OK);
    ctx_free(&c);

    /* Eviction and growth: a table of 4096 filled far past its size keeps its bound. */
    ctx_init(&c, 4096, 1 << 20);
    uint8_t block[64];
    for (int i = 0; i < 10000; i++) {
        int n = snprintf((char *)block + 3, sizeof block - 3, "value-%d", i);
        block[0] = 0x40 | 0; /* literal, new name */
        block[1] = 1;
        block[2] = 'x';
        memmove(block + 4, block + 3, (size_t)n);
        block[3] = (uint8_t)n;
        CHECK(decode(&c, block, (size_t)n + 4) == VX_HPACK_OK);
        CHECK(c.d.size <= 4096);
    }
    uint8_t newest[1] = {0xBE}; /* index 62: the newest entry */
    CHECK(decode(&c, newest, 1) == VX_HPACK_OK && field_is(&c, 0, "x", "value-9999"));
    ctx_free(&c);
}

static void test_encoder(void)
{
    vx_buf out = {0};
    /* :method POST is static entry 3; accept-encoding "gzip, deflate" is 16. */
    CHECK(vx_hpack_encode_field(&out, (const uint8_t *)":method", 7, (const uint8_t *)"POST", 4, false));
    CHECK(out.len == 1 && out.p[0] == 0x83);
    out.len = 0;
    CHECK(vx_hpack_encode_field(&out, (const uint8_t *)"accept-encoding", 15,
                                (const uint8_t *)"gzip, deflate", 13, false));
    CHECK(out.len == 1 && out.p[0] == 0x90);
    out.len = 0;
    /* content-type (31) literal without indexing: 0x0f 0x10, then the value. */
    CHECK(vx_hpack_encode_field(&out, (const uint8_t *)"content-type", 12, (const uint8_t *)"a", 1, false));
    CHECK(out.len == 4 && out.p[0] == 0x0F && out.p[1] == 0x10 && out.p[2] == 1 && out.p[3] == 'a');
    out.len = 0;
    /* authorization (23), never indexed: 0x1f 0x08. */
    CHECK(vx_hpack_sensitive((const uint8_t *)"authorization", 13));
    CHECK(!vx_hpack_sensitive((const uint8_t *)"user-agent", 10));
    CHECK(vx_hpack_encode_field(&out, (const uint8_t *)"authorization", 13, (const uint8_t *)"k", 1, true));
    CHECK(out.len == 4 && out.p[0] == 0x1F && out.p[1] == 0x08);
    out.len = 0;
    /* An unknown name: 0x00, name length, name, value length, value. */
    CHECK(vx_hpack_encode_field(&out, (const uint8_t *)"x-a", 3, (const uint8_t *)"", 0, false));
    CHECK(out.len == 6 && out.p[0] == 0 && out.p[1] == 3 && out.p[5] == 0);
    /* Whatever the encoder writes, the decoder reads back. */
    ctx c;
    ctx_init(&c, 4096, 65536);
    out.len = 0;
    char value[300];
    memset(value, 'v', sizeof value);
    vx_hpack_encode_field(&out, (const uint8_t *)"x-long", 6, (const uint8_t *)value, 300, false);
    vx_hpack_encode_field(&out, (const uint8_t *)"cookie", 6, (const uint8_t *)"c=1", 3, true);
    CHECK(decode(&c, out.p, out.len) == VX_HPACK_OK && c.fields.len == 2);
    CHECK(c.fields.p[0].value_len == 300 && field_is(&c, 1, "cookie", "c=1"));
    ctx_free(&c);
    vx_buf_free(&out);
}

int main(void)
{
    test_rfc7541_c6();
    test_huffman_round_trip();
    test_huffman_hostile();
    test_hostile_blocks();
    test_encoder();
    if (failures) {
        fprintf(stderr, "test_hpack: %d failures\n", failures);
        return 1;
    }
    printf("test_hpack: ok\n");
    return 0;
}
