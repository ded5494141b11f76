/* test_h2.c: the native HTTP/2 client codec under well-formed and hostile server input.
 * The conformance suites (tests/egress, against a real `h2` server) cover the protocol; this
 * program covers what must never crash, hang or grow without bound, and runs under ASan +
 * UBSan and TSan too: CONTINUATION floods, endless header blocks, bad padding, window
 * overflow, frames on closed streams, peer table size changes, bad HPACK, oversized frames,
 * every split of a response, and random bytes. */
#include "check.h"
#include "vx_h2.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static vx_buf wire; /* server bytes being built */

static void frame(uint8_t type, uint8_t flags, uint32_t sid, const void *payload, size_t n)
{
    uint8_t h[9] = {(uint8_t)(n >> 16), (uint8_t)(n >> 8), (uint8_t)n, type, flags,
                    (uint8_t)(sid >> 24), (uint8_t)(sid >> 16), (uint8_t)(sid >> 8), (uint8_t)sid};
    vx_buf_append(&wire, h, 9);
    vx_buf_append(&wire, payload, n);
}

static void u32frame(uint8_t type, uint32_t sid, uint32_t v)
{
    uint8_t p[4] = {(uint8_t)(v >> 24), (uint8_t)(v >> 16), (uint8_t)(v >> 8), (uint8_t)v};
    frame(type, 0, sid, p, 4);
}

/* A codec past the handshake with one GET open on stream 1. */
static vx_h2 *ready(void)
{
    vx_h2 *c = vx_h2_new((const uint8_t *)"api.example.com", 15, (const uint8_t *)"https", 5);
    CHECK(c != NULL);
    CHECK(vx_h2_initiate(c) == VX_H2_OK);
    size_t n;
    const uint8_t *out = vx_h2_output(c, &n);
    CHECK(n > 24 && memcmp(out, "PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n", 24) == 0);
    vx_h2_output_done(c);
    wire.len = 0;
    frame(4, 0, 0, "", 0);
    CHECK(vx_h2_receive(c, wire.p, wire.len) == VX_H2_OK);
    const vx_h2_event *ev = vx_h2_events(c, &n);
    CHECK(n == 1 && ev[0].kind == VX_EV_SETTINGS && ev[0].sid == 512);
    uint32_t sid;
    CHECK(vx_h2_send_request(c, (const uint8_t *)"GET", 3, (const uint8_t *)"/", 1, NULL, 0, NULL,
                             0, &sid) == VX_H2_OK);
    CHECK(sid == 1);
    vx_h2_output(c, &n);
    vx_h2_output_done(c);
    wire.len = 0;
    return c;
}

/* Feed `wire` and expect a connection error with `code` and a GOAWAY carrying it. */
static void expect_error(vx_h2 *c, uint32_t code)
{
    CHECK(vx_h2_receive(c, wire.p, wire.len) == VX_H2_ERROR);
    CHECK(vx_h2_error_code(c) == code);
    size_t n;
    const uint8_t *out = vx_h2_output(c, &n);
    CHECK(n >= 17 && out[3] == 7); /* GOAWAY */
    CHECK(n >= 17 && out[16] == (uint8_t)code);
    uint32_t sid;
    CHECK(vx_h2_send_request(c, (const uint8_t *)"GET", 3, (const uint8_t *)"/", 1, NULL, 0, NULL,
                             0, &sid) == VX_H2_REFUSED);
    CHECK(vx_h2_receive(c, (const uint8_t *)"x", 1) == VX_H2_ERROR); /* stays failed */
    vx_h2_free(c);
}

static void test_response_every_split(void)
{
    vx_h2 *c = ready();
    /* :status 200 + x-a: b (literal, incremental indexing), then 3 DATA frames, one padded. */
    frame(1, 4, 1, "\x88\x40\x03x-a\x01" "b", 8);
    frame(0, 0, 1, "hello", 5);
    frame(0, 8, 1, "\x02wo\0\0", 5);
    frame(0, 1, 1, "rld", 3);
    vx_buf all = {0};
    vx_buf_append(&all, wire.p, wire.len);
    vx_h2_free(c);
    for (size_t cut = 0; cut <= all.len; cut++) {
        for (size_t cut2 = cut; cut2 <= all.len; cut2 += 7) {
            c = ready();
            size_t kinds = 0, data = 0, n;
            const size_t cuts[4] = {0, cut, cut2, all.len};
            for (int i = 0; i < 3; i++) {
                CHECK(vx_h2_receive(c, all.p + cuts[i], cuts[i + 1] - cuts[i]) == VX_H2_OK);
                const vx_h2_event *ev = vx_h2_events(c, &n);
                for (size_t j = 0; j < n; j++) {
                    kinds = kinds * 10 + ev[j].kind;
                    if (ev[j].kind == VX_EV_RESPONSE) {
                        CHECK(ev[j].value == 200 && ev[j].count == 1);
                        const vx_hfield *f = &vx_h2_fields(c)[ev[j].first];
                        CHECK(f->name_len == 3 &&
                              memcmp(vx_h2_arena(c) + f->name_off, "x-a", 3) == 0);
                    }
                    if (ev[j].kind == VX_EV_DATA)
                        data += ev[j].len * 100 + ev[j].value;
                }
            }
            CHECK(kinds == 1222);
            CHECK(data == 505 + 205 + 303);
            CHECK(vx_h2_stream_count(c) == 0);
            vx_h2_free(c);
        }
    }
    vx_buf_free(&all);
}

static void test_continuation_flood(void)
{
    vx_h2 *c = ready();
    frame(1, 0, 1, "\x88", 1);
    for (int i = 0; i < VX_H2_MAX_CONTINUATIONS + 1; i++)
        frame(9, 0, 1, "", 0);
    expect_error(c, VX_H2_ENHANCE_YOUR_CALM);
}

static void test_endless_header_block(void)
{
    vx_h2 *c = ready();
    static uint8_t chunk[16384];
    memset(chunk, 0x88, sizeof chunk);
    frame(1, 0, 1, chunk, sizeof chunk);
    for (int i = 0; i < 8; i++)
        frame(9, 0, 1, chunk, sizeof chunk); /* 144 KiB > 128 KiB */
    expect_error(c, VX_H2_ENHANCE_YOUR_CALM);
}

static void test_header_list_over_limit(void)
{
    vx_h2 *c = ready();
    /* One indexed field repeated: 8 KiB of 0xbe after one literal makes a 64 KiB+ list. */
    static uint8_t block[4000];
    size_t n = 0;
    block[n++] = 0x88;
    block[n++] = 0x40;
    block[n++] = 1;
    block[n++] = 'x';
    block[n++] = 0x7F; /* value length 127 + 100 = 227 */
    block[n++] = 100;
    memset(block + n, 'v', 227);
    n += 227;
    while (n < sizeof block)
        block[n++] = 0xBE; /* the entry just added, 260 accounted bytes each */
    frame(1, 5, 1, block, n);
    expect_error(c, VX_H2_ENHANCE_YOUR_CALM);
}

static void test_bad_padding(void)
{
    vx_h2 *c = ready();
    frame(1, 4, 1, "\x88", 1);
    frame(0, 8, 1, "\x05" "abcd", 5); /* pad length 5 of a 5-byte payload */
    expect_error(c, VX_H2_PROTOCOL_ERROR);
    c = ready();
    frame(0, 8, 1, "", 0); /* PADDED without the pad length */
    expect_error(c, VX_H2_FRAME_SIZE_ERROR);
    c = ready();
    frame(1, 0x28, 1, "\x00\x01\x02", 3); /* PADDED + PRIORITY, too short for priority */
    expect_error(c, VX_H2_FRAME_SIZE_ERROR);
}

static void test_window_overflow(void)
{
    vx_h2 *c = ready();
    u32frame(8, 0, 0x7FFFFFFF);
    expect_error(c, VX_H2_FLOW_CONTROL_ERROR);
    /* A stream window overflow resets only the stream. */
    c = ready();
    u32frame(8, 1, 0x7FFFFFFF);
    CHECK(vx_h2_receive(c, wire.p, wire.len) == VX_H2_OK);
    size_t n;
    const vx_h2_event *ev = vx_h2_events(c, &n);
    CHECK(n == 1 && ev[0].kind == VX_EV_RESET && ev[0].value == VX_H2_FLOW_CONTROL_ERROR);
    CHECK(vx_h2_stream_count(c) == 0);
    vx_h2_free(c);
    /* SETTINGS_INITIAL_WINDOW_SIZE above 2^31 - 1. */
    c = ready();
    frame(4, 0, 0, "\x00\x04\x80\x00\x00\x00", 6);
    expect_error(c, VX_H2_FLOW_CONTROL_ERROR);
    /* More DATA than the 8 MiB stream window, never acknowledged. */
    c = ready();
    frame(1, 4, 1, "\x88", 1);
    static uint8_t chunk[16384];
    for (int i = 0; i <= VX_H2_LOCAL_INITIAL_WINDOW_SIZE / 16384; i++)
        frame(0, 0, 1, chunk, sizeof chunk);
    expect_error(c, VX_H2_FLOW_CONTROL_ERROR);
}

static void test_closed_and_idle_streams(void)
{
    vx_h2 *c = ready();
    frame(1, 5, 1, "\x88", 1);          /* complete response: stream 1 is gone */
    frame(0, 0, 1, "late", 4);          /* dropped, credited to the connection */
    frame(1, 5, 1, "\x88", 1);          /* decoded (shared table), dropped */
    u32frame(3, 1, VX_H2_CANCEL);       /* dropped */
    CHECK(vx_h2_receive(c, wire.p, wire.len) == VX_H2_OK);
    size_t n;
    vx_h2_events(c, &n);
    CHECK(n == 1);
    wire.len = 0;
    frame(0, 0, 3, "x", 1); /* stream 3 was never opened */
    expect_error(c, VX_H2_PROTOCOL_ERROR);
    c = ready();
    frame(0, 0, 0, "x", 1); /* DATA on stream 0 */
    expect_error(c, VX_H2_PROTOCOL_ERROR);
    c = ready();
    frame(5, 4, 1, "\x00\x00\x00\x02\x88", 5); /* PUSH_PROMISE */
    expect_error(c, VX_H2_PROTOCOL_ERROR);
}

static void test_table_sizes(void)
{
    /* The peer lowers its HEADER_TABLE_SIZE: our next block starts with an update to 0. */
    vx_h2 *c = ready();
    frame(4, 0, 0, "\x00\x01\x00\x00\x00\x00", 6);
    CHECK(vx_h2_receive(c, wire.p, wire.len) == VX_H2_OK);
    size_t n;
    vx_h2_output(c, &n);
    vx_h2_output_done(c);
    uint32_t sid;
    CHECK(vx_h2_send_request(c, (const uint8_t *)"GET", 3, (const uint8_t *)"/", 1, NULL, 0, NULL,
                             0, &sid) == VX_H2_OK);
    const uint8_t *out = vx_h2_output(c, &n);
    CHECK(n > 10 && out[3] == 1 && out[9] == 0x20);
    vx_h2_output_done(c);
    vx_h2_free(c);
    /* The peer's encoder asks for a table larger than we allow: COMPRESSION_ERROR. */
    c = ready();
    frame(1, 5, 1, "\x3f\xe2\x1f\x88", 4);
    expect_error(c, VX_H2_COMPRESSION_ERROR);
    /* A size update after a field. */
    c = ready();
    frame(1, 5, 1, "\x88\x20", 2);
    expect_error(c, VX_H2_COMPRESSION_ERROR);
    /* A legal shrink to 0 and back: entries are evicted, later references fail. */
    c = ready();
    frame(1, 4, 1, "\x88\x40\x01x\x01y", 6);
    frame(1, 5, 1, "\x20\x3f\xe1\x1f\xbe", 5); /* trailers: 0, 4096, then index 62 */
    expect_error(c, VX_H2_COMPRESSION_ERROR);
}

static void test_bad_hpack(void)
{
    const char *blocks[] = {
        "\x88\x00\x81\xff\x01" "a",      /* Huffman name that is EOS */
        "\x88\x00\x01" "a\x82\x1e\x00", /* Huffman value with padding that is not all ones */
        "\x88\xff\xff\xff\xff\xff\x0f",  /* index with an over-long varint */
        "\x88\x0f\x10\x7f\xff\xff\xff\xff\x0f", /* string length past the block */
    };
    const size_t lens[] = {6, 7, 7, 9};
    for (size_t i = 0; i < 4; i++) {
        vx_h2 *c = ready();
        frame(1, 5, 1, blocks[i], lens[i]);
        expect_error(c, VX_H2_COMPRESSION_ERROR);
    }
}

static void test_oversized_frame_rejected_from_its_header(void)
{
    vx_h2 *c = ready();
    CHECK(vx_h2_receive(c, (const uint8_t *)"HTTP/1.1 400 Bad", 16) == VX_H2_ERROR);
    CHECK(vx_h2_error_code(c) == VX_H2_FRAME_SIZE_ERROR);
    vx_h2_free(c);
}

static void test_random_input(void)
{
    /* Random frames of every type after the handshake, fed whole and byte by byte: no crash, no
     * leak (ASan), and a failed codec stays failed. Fixed seed. */
    unsigned seed = 12345;
    for (int round = 0; round < 3000; round++) {
        vx_h2 *c = ready();
        int frames = 1 + (int)(rand_r(&seed) % 6);
        for (int f = 0; f < frames; f++) {
            uint8_t payload[40];
            size_t n = (size_t)(rand_r(&seed) % sizeof payload);
            for (size_t i = 0; i < n; i++)
                payload[i] = (uint8_t)rand_r(&seed);
            static const uint32_t sids[] = {0, 1, 3, 0x80000001};
            frame((uint8_t)(rand_r(&seed) % 12), (uint8_t)rand_r(&seed), sids[rand_r(&seed) % 4],
                  payload, n);
        }
        if (round & 1) {
            vx_h2_receive(c, wire.p, wire.len);
        } else {
            for (size_t i = 0; i < wire.len; i++)
                if (vx_h2_receive(c, wire.p + i, 1) != VX_H2_OK)
                    break;
        }
        size_t n;
        vx_h2_output(c, &n);
        vx_h2_output_done(c);
        vx_h2_free(c);
        wire.len = 0;
    }
}

static void test_large_upload_and_reset(void)
{
    vx_h2 *c = ready();
    static uint8_t body[3 * 1024 * 1024];
    uint32_t sid;
    CHECK(vx_h2_send_request(c, (const uint8_t *)"POST", 4, (const uint8_t *)"/u", 2, NULL, 0,
                             body, sizeof body, &sid) == VX_H2_OK);
    CHECK(sid == 3);
    u32frame(8, 0, 0x7FFFFFFF - 65535);   /* open the connection window */
    frame(4, 0, 0, "\x00\x04\x7f\xff\xff\xff", 6); /* and every stream window */
    CHECK(vx_h2_receive(c, wire.p, wire.len) == VX_H2_OK);
    size_t n, total = 0;
    for (int calls = 0; calls < 10; calls++) {
        vx_h2_output(c, &n);
        total += n;
        vx_h2_output_done(c);
        if (!vx_h2_data_pending(c))
            break;
    }
    CHECK(total > sizeof body);
    CHECK(!vx_h2_data_pending(c));
    vx_h2_reset_stream(c, 3, VX_H2_CANCEL);
    vx_h2_reset_stream(c, 1, VX_H2_CANCEL);
    CHECK(vx_h2_stream_count(c) == 0);
    CHECK(vx_h2_acknowledge(c, 3, 100) == VX_H2_OK);
    CHECK(vx_h2_acknowledge(c, 5, 100) == VX_H2_ERROR);
    vx_h2_free(c);
}

/* A stream's tag rides on its DATA events only while the codec holds the stream; a stream
 * reused from the free list starts untagged. */
static void test_tags(void)
{
    vx_h2 *c = ready();
    CHECK(vx_h2_tag(c, 1) == 0);
    CHECK(vx_h2_set_tag(c, 1, 7) == VX_H2_OK);
    CHECK(vx_h2_set_tag(c, 3, 7) == VX_H2_ERROR); /* never opened */
    CHECK(vx_h2_tag(c, 1) == 7);
    frame(1, 4, 1, "\x88", 1);
    frame(0, 0, 1, "ab", 2);
    frame(0, 1, 1, "c", 1);
    CHECK(vx_h2_receive(c, wire.p, wire.len) == VX_H2_OK);
    size_t n;
    const vx_h2_event *ev = vx_h2_events(c, &n);
    CHECK(n == 3 && ev[0].tag == 0 && ev[1].tag == 7 && ev[2].tag == 7);
    CHECK(vx_h2_tag(c, 1) == 0); /* over both ways: forgotten */
    uint32_t sid;
    CHECK(vx_h2_send_request(c, (const uint8_t *)"GET", 3, (const uint8_t *)"/", 1, NULL, 0, NULL,
                             0, &sid) == VX_H2_OK);
    CHECK(sid == 3 && vx_h2_tag(c, 3) == 0);
    vx_h2_free(c);
    wire.len = 0;
}

int main(void)
{
    test_response_every_split();
    test_continuation_flood();
    test_endless_header_block();
    test_header_list_over_limit();
    test_bad_padding();
    test_window_overflow();
    test_closed_and_idle_streams();
    test_table_sizes();
    test_bad_hpack();
    test_oversized_frame_rejected_from_its_header();
    test_random_input();
    test_large_upload_and_reset();
    test_tags();
    vx_buf_free(&wire);
    if (failures) {
        fprintf(stderr, "test_h2: %d failures\n", failures);
        return 1;
    }
    printf("test_h2: ok\n");
    return 0;
}
