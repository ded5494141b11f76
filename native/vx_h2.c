/* vx_h2.c: the native HTTP/2 client codec (see vx_h2.h). A line-by-line port of the Python
 * framer's state machine (velox/egress/framer.py): where this file makes a choice, the framer
 * made it first, and CODECS.md says why. */
#include "vx_h2.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* Frame types and flags (RFC 9113 section 6). */
enum {
    F_DATA = 0,
    F_HEADERS = 1,
    F_PRIORITY = 2,
    F_RST_STREAM = 3,
    F_SETTINGS = 4,
    F_PUSH_PROMISE = 5,
    F_PING = 6,
    F_GOAWAY = 7,
    F_WINDOW_UPDATE = 8,
    F_CONTINUATION = 9,
};
#define FL_END_STREAM 0x1
#define FL_ACK 0x1
#define FL_END_HEADERS 0x4
#define FL_PADDED 0x8
#define FL_PRIORITY 0x20

#define STREAM_WINDOW_UPDATE_THRESHOLD (VX_H2_LOCAL_INITIAL_WINDOW_SIZE / 2)
#define CONNECTION_WINDOW_UPDATE_THRESHOLD (VX_H2_LOCAL_CONNECTION_WINDOW / 2)
#define MAX_PEER_FRAME_SIZE 16777215
#define MAX_GOAWAY_DEBUG 256

/* Buffers that one burst may have grown are given back above these sizes (bytes): the usual
 * traffic (64 requests of a few KiB out, a read of a few hundred KiB in) stays below them. */
#define KEEP_OUT (256 * 1024)
#define KEEP_ARENA (256 * 1024)
#define KEEP_BLOCK (32 * 1024)
#define KEEP_EVENTS 4096
#define KEEP_FIELDS 16384
#define FREE_STREAMS_KEPT 256

/* Receive-side stream states. */
enum { RX_AWAITING_RESPONSE, RX_RECEIVING_BODY, RX_REMOTE_CLOSED };
/* Parser states: what frames are legal next. */
enum { P_PREFACE, P_NORMAL, P_CONTINUATION };

typedef struct vx_stream {
    uint32_t sid;
    uint32_t tag; /* the caller's (vx_h2_set_tag), 0 until set; carried by its DATA events */
    uint8_t rx;
    bool tx_open;
    bool blocked;
    int64_t send_window;
    int64_t recv_window;
    int64_t unacked;
    uint8_t *body; /* unsent rest of the request body (owned), or NULL */
    size_t body_len;
    size_t body_off;
    struct vx_stream *bprev, *bnext; /* blocked list, in the order streams blocked */
    struct vx_stream *next_free;
} vx_stream;

struct vx_h2 {
    vx_buf authority;
    vx_buf scheme;
    vx_buf out;
    /* Streams: open addressing on the id, linear probing, backward-shift deletion. */
    vx_stream **slots;
    uint32_t map_cap;
    uint32_t map_count;
    vx_stream *bhead, *btail;
    vx_stream *free_streams;
    uint32_t n_free;
    int64_t budget;
    bool deferred;
    uint64_t next_sid;
    const char *refusal;
    bool failed;
    bool goaway_sent;
    bool nomem;
    uint32_t err_code;
    char err_msg[160];
    int64_t conn_send_window;
    int64_t conn_recv_window;
    int64_t conn_unacked;
    int64_t peer_initial_window;
    uint32_t peer_max_frame;
    uint32_t max_streams;
    bool table_update;
    bool table_zeroed;
    /* Input that does not complete a frame. Two buffers: events may point into the one whose
     * frame was just completed, while the tail of the same read goes into the other. */
    vx_buf held[2];
    int hi;
    size_t need;
    uint8_t state;
    /* Header block being reassembled from HEADERS + CONTINUATION. */
    uint32_t hb_sid;
    bool hb_end_stream;
    uint32_t hb_frames;
    vx_buf hb;
    vx_hpack_decoder dec;
    /* The events of the current receive call. */
    vx_h2_event *ev;
    size_t nev;
    size_t ev_cap;
    vx_hfields fields;
    vx_hfields block_fields;
    vx_buf arena;
};

static const uint8_t PREFACE[] = "PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

/* ------------------------------------------------------------------------------ helpers */

static uint32_t be32(const uint8_t *p)
{
    return (uint32_t)p[0] << 24 | (uint32_t)p[1] << 16 | (uint32_t)p[2] << 8 | p[3];
}

static void put32(uint8_t *p, uint32_t v)
{
    p[0] = (uint8_t)(v >> 24);
    p[1] = (uint8_t)(v >> 16);
    p[2] = (uint8_t)(v >> 8);
    p[3] = (uint8_t)v;
}

static void put_head_at(uint8_t *p, size_t len, uint8_t type, uint8_t flags, uint32_t sid)
{
    p[0] = (uint8_t)(len >> 16);
    p[1] = (uint8_t)(len >> 8);
    p[2] = (uint8_t)len;
    p[3] = type;
    p[4] = flags;
    put32(p + 5, sid);
}

static void put_head(vx_h2 *c, size_t len, uint8_t type, uint8_t flags, uint32_t sid)
{
    if (!vx_buf_reserve(&c->out, 9)) {
        c->nomem = true;
        return;
    }
    put_head_at(c->out.p + c->out.len, len, type, flags, sid);
    c->out.len += 9;
}

static void put_bytes(vx_h2 *c, const void *p, size_t n)
{
    if (!vx_buf_append(&c->out, p, n))
        c->nomem = true;
}

/* A frame carrying one 32-bit field: RST_STREAM and WINDOW_UPDATE. */
static void put_u32_frame(vx_h2 *c, uint8_t type, uint32_t sid, uint32_t value)
{
    uint8_t f[13];
    put_head_at(f, 4, type, 0, sid);
    put32(f + 9, value);
    put_bytes(c, f, 13);
}

/* ------------------------------------------------------------------------------ streams */

static uint32_t slot_of(const vx_h2 *c, uint32_t sid)
{
    return ((sid >> 1) * 2654435761u) & (c->map_cap - 1);
}

static vx_stream *find(const vx_h2 *c, uint32_t sid)
{
    for (uint32_t i = slot_of(c, sid);; i = (i + 1) & (c->map_cap - 1)) {
        vx_stream *s = c->slots[i];
        if (s == NULL || s->sid == sid)
            return s;
    }
}

static bool map_grow(vx_h2 *c)
{
    uint32_t old_cap = c->map_cap;
    vx_stream **old = c->slots;
    uint32_t cap = old_cap * 2;
    vx_stream **slots = calloc(cap, sizeof *slots);
    if (slots == NULL)
        return false;
    c->slots = slots;
    c->map_cap = cap;
    for (uint32_t i = 0; i < old_cap; i++) {
        if (old[i] == NULL)
            continue;
        uint32_t j = slot_of(c, old[i]->sid);
        while (slots[j])
            j = (j + 1) & (cap - 1);
        slots[j] = old[i];
    }
    free(old);
    return true;
}

static vx_stream *add_stream(vx_h2 *c, uint32_t sid)
{
    if ((c->map_count + 1) * 2 > c->map_cap && !map_grow(c))
        return NULL;
    vx_stream *s = c->free_streams;
    if (s) {
        c->free_streams = s->next_free;
        c->n_free--;
    } else if ((s = malloc(sizeof *s)) == NULL) {
        return NULL;
    }
    memset(s, 0, sizeof *s);
    s->sid = sid;
    s->tx_open = true;
    s->rx = RX_AWAITING_RESPONSE;
    s->send_window = c->peer_initial_window;
    s->recv_window = VX_H2_LOCAL_INITIAL_WINDOW_SIZE;
    uint32_t i = slot_of(c, sid);
    while (c->slots[i])
        i = (i + 1) & (c->map_cap - 1);
    c->slots[i] = s;
    c->map_count++;
    return s;
}

static void unblock(vx_h2 *c, vx_stream *s)
{
    if (!s->blocked)
        return;
    if (s->bprev)
        s->bprev->bnext = s->bnext;
    else
        c->bhead = s->bnext;
    if (s->bnext)
        s->bnext->bprev = s->bprev;
    else
        c->btail = s->bprev;
    s->bprev = s->bnext = NULL;
    s->blocked = false;
}

static void block(vx_h2 *c, vx_stream *s)
{
    if (s->blocked)
        return;
    s->blocked = true;
    s->bnext = NULL;
    s->bprev = c->btail;
    if (c->btail)
        c->btail->bnext = s;
    else
        c->bhead = s;
    c->btail = s;
}

/* Forget a stream: its slot, its place in the blocked list, its body. */
static void remove_stream(vx_h2 *c, vx_stream *s)
{
    uint32_t mask = c->map_cap - 1;
    uint32_t i = slot_of(c, s->sid);
    while (c->slots[i] != s)
        i = (i + 1) & mask;
    /* Backward-shift deletion keeps every probe chain unbroken without tombstones. */
    uint32_t j = i;
    for (;;) {
        c->slots[i] = NULL;
        for (;;) {
            j = (j + 1) & mask;
            if (c->slots[j] == NULL)
                goto removed;
            uint32_t k = slot_of(c, c->slots[j]->sid);
            /* Move slots[j] into the hole at i unless its home k lies cyclically in (i, j]. */
            if (i <= j ? (i < k && k <= j) : (i < k || k <= j))
                continue;
            break;
        }
        c->slots[i] = c->slots[j];
        i = j;
    }
removed:
    c->map_count--;
    unblock(c, s);
    free(s->body);
    s->body = NULL;
    if (c->n_free < FREE_STREAMS_KEPT) {
        s->next_free = c->free_streams;
        c->free_streams = s;
        c->n_free++;
    } else {
        free(s);
    }
}

static bool opened(const vx_h2 *c, uint32_t sid)
{
    return (sid & 1) && sid > 0 && sid < c->next_sid;
}

/* ------------------------------------------------------------------------------ lifecycle */

vx_h2 *vx_h2_new(const uint8_t *authority, size_t authority_len, const uint8_t *scheme,
                 size_t scheme_len)
{
    vx_h2 *c = calloc(1, sizeof *c);
    if (c == NULL)
        return NULL;
    c->map_cap = 16;
    c->slots = calloc(c->map_cap, sizeof *c->slots);
    bool ok = c->slots != NULL &&
              vx_hpack_decoder_init(&c->dec, VX_H2_LOCAL_HEADER_TABLE_SIZE,
                                    VX_H2_LOCAL_MAX_HEADER_LIST_SIZE) &&
              vx_buf_append(&c->authority, authority, authority_len) &&
              vx_buf_append(&c->scheme, scheme, scheme_len);
    c->budget = VX_H2_DATA_PER_CALL;
    c->next_sid = 1;
    c->conn_send_window = 65535;
    c->conn_recv_window = 65535;
    c->peer_initial_window = 65535;
    c->peer_max_frame = 16384;
    c->max_streams = VX_H2_DEFAULT_MAX_CONCURRENT_STREAMS;
    c->need = 9;
    c->state = P_PREFACE;
    if (!ok) {
        vx_h2_free(c);
        return NULL;
    }
    return c;
}

void vx_h2_free(vx_h2 *c)
{
    if (c == NULL)
        return;
    if (c->slots) {
        for (uint32_t i = 0; i < c->map_cap; i++) {
            if (c->slots[i]) {
                free(c->slots[i]->body);
                free(c->slots[i]);
            }
        }
        free(c->slots);
    }
    while (c->free_streams) {
        vx_stream *s = c->free_streams;
        c->free_streams = s->next_free;
        free(s);
    }
    vx_hpack_decoder_free(&c->dec);
    vx_buf_free(&c->authority);
    vx_buf_free(&c->scheme);
    vx_buf_free(&c->out);
    vx_buf_free(&c->held[0]);
    vx_buf_free(&c->held[1]);
    vx_buf_free(&c->hb);
    vx_buf_free(&c->arena);
    free(c->ev);
    free(c->fields.p);
    free(c->block_fields.p);
    free(c);
}

/* ------------------------------------------------------------------------------ errors */

static void queue_goaway(vx_h2 *c, uint32_t code, const char *debug, size_t n)
{
    c->goaway_sent = true;
    uint8_t f[17];
    put_head_at(f, 8 + n, F_GOAWAY, 0, 0);
    put32(f + 9, 0); /* last stream id: a client accepts no server-initiated streams */
    put32(f + 13, code);
    put_bytes(c, f, 17);
    put_bytes(c, debug, n);
}

/* A connection error: queue GOAWAY with the code and the reason, refuse new streams. */
static int fail(vx_h2 *c, uint32_t code, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(c->err_msg, sizeof c->err_msg, fmt, ap);
    va_end(ap);
    if (n < 0)
        n = 0;
    if ((size_t)n >= sizeof c->err_msg)
        n = (int)sizeof c->err_msg - 1;
    if (!c->goaway_sent)
        queue_goaway(c, code, c->err_msg, (size_t)n < MAX_GOAWAY_DEBUG ? (size_t)n : MAX_GOAWAY_DEBUG);
    c->refusal = "connection failed";
    c->failed = true;
    c->err_code = code;
    return VX_H2_ERROR;
}

/* ------------------------------------------------------------------------------ events */

static vx_h2_event *push_event(vx_h2 *c, uint8_t kind, uint32_t sid)
{
    if (c->nev == c->ev_cap) {
        size_t cap = c->ev_cap ? c->ev_cap * 2 : 64;
        vx_h2_event *ev = realloc(c->ev, cap * sizeof *ev);
        if (ev == NULL) {
            c->nomem = true;
            return NULL;
        }
        c->ev = ev;
        c->ev_cap = cap;
    }
    vx_h2_event *e = &c->ev[c->nev++];
    memset(e, 0, sizeof *e);
    e->kind = kind;
    e->sid = sid;
    return e;
}

static void stream_error(vx_h2 *c, vx_stream *s, uint32_t code)
{
    uint32_t sid = s->sid;
    remove_stream(c, s);
    put_u32_frame(c, F_RST_STREAM, sid, code);
    vx_h2_event *e = push_event(c, VX_EV_RESET, sid);
    if (e)
        e->value = code;
}

/* ------------------------------------------------------------------------------ sending */

int vx_h2_initiate(vx_h2 *c)
{
    uint8_t s[18 + 13];
    put_bytes(c, PREFACE, sizeof PREFACE - 1);
    put_head(c, 18, F_SETTINGS, 0, 0);
    /* ENABLE_PUSH=0, INITIAL_WINDOW_SIZE, MAX_HEADER_LIST_SIZE: 16-bit id, 32-bit value. */
    s[0] = 0, s[1] = 2, put32(s + 2, 0);
    s[6] = 0, s[7] = 4, put32(s + 8, VX_H2_LOCAL_INITIAL_WINDOW_SIZE);
    s[12] = 0, s[13] = 6, put32(s + 14, VX_H2_LOCAL_MAX_HEADER_LIST_SIZE);
    put_head_at(s + 18, 4, F_WINDOW_UPDATE, 0, 0);
    put32(s + 27, (uint32_t)(VX_H2_LOCAL_CONNECTION_WINDOW - c->conn_recv_window));
    put_bytes(c, s, sizeof s);
    c->conn_recv_window = VX_H2_LOCAL_CONNECTION_WINDOW;
    return c->nomem ? VX_H2_NOMEM : VX_H2_OK;
}

static void encode(vx_h2 *c, const uint8_t *name, size_t nlen, const uint8_t *value, size_t vlen,
                   bool never_indexed)
{
    if (!vx_hpack_encode_field(&c->out, name, nlen, value, vlen, never_indexed))
        c->nomem = true;
}

static void write_headers(vx_h2 *c, uint32_t sid, const uint8_t *method, size_t method_len,
                          const uint8_t *path, size_t path_len, const vx_h2_header *headers,
                          size_t n, uint8_t flags)
{
    /* Encode straight behind a placeholder frame header, filled in once the length is known. */
    size_t at = c->out.len;
    put_bytes(c, "\0\0\0\0\0\0\0\0\0", 9);
    if (c->table_update) {
        put_bytes(c, "\x20", 1); /* dynamic table size update to 0: legal under any limit */
        c->table_update = false;
        c->table_zeroed = true;
    }
    encode(c, (const uint8_t *)":method", 7, method, method_len, false);
    encode(c, (const uint8_t *)":scheme", 7, c->scheme.p, c->scheme.len, false);
    encode(c, (const uint8_t *)":authority", 10, c->authority.p, c->authority.len, false);
    encode(c, (const uint8_t *)":path", 5, path, path_len, false);
    for (size_t i = 0; i < n; i++) {
        const vx_h2_header *h = &headers[i];
        encode(c, h->name, h->name_len, h->value, h->value_len,
               vx_hpack_sensitive(h->name, h->name_len));
    }
    if (c->nomem)
        return;
    size_t size = c->out.len - at - 9;
    if (size <= c->peer_max_frame) {
        put_head_at(c->out.p + at, size, F_HEADERS, flags, sid);
        return;
    }
    /* Split into HEADERS + CONTINUATION frames of the peer's maximum frame size. */
    uint8_t *block = malloc(size);
    if (block == NULL) {
        c->nomem = true;
        return;
    }
    memcpy(block, c->out.p + at + 9, size);
    c->out.len = at;
    uint8_t type = F_HEADERS, first_flags = flags & (uint8_t)~FL_END_HEADERS;
    for (size_t off = 0; off < size; off += c->peer_max_frame) {
        size_t chunk = size - off < c->peer_max_frame ? size - off : c->peer_max_frame;
        bool last = off + chunk == size;
        put_head(c, chunk, type, (uint8_t)(first_flags | (last ? FL_END_HEADERS : 0)), sid);
        put_bytes(c, block + off, chunk);
        type = F_CONTINUATION;
        first_flags = 0;
    }
    free(block);
}

static void end_local(vx_h2 *c, vx_stream *s)
{
    s->tx_open = false;
    free(s->body);
    s->body = NULL;
    unblock(c, s);
    if (s->rx == RX_REMOTE_CLOSED)
        remove_stream(c, s);
}

/* Frame as much of body[off:total] as the windows and the per-call budget allow; return the new
 * offset. When the body is complete the stream may be freed: callers must not touch it then
 * (they can tell by the returned offset being `total`). */
static size_t write_data(vx_h2 *c, vx_stream *s, const uint8_t *body, size_t total, size_t off)
{
    int64_t n = (int64_t)(total - off);
    if (c->conn_send_window < n)
        n = c->conn_send_window;
    if (s->send_window < n)
        n = s->send_window;
    if (n > c->budget) {
        n = c->budget;
        c->deferred = true;
    }
    if (n <= 0)
        return off;
    c->conn_send_window -= n;
    s->send_window -= n;
    c->budget -= n;
    size_t stop = off + (size_t)n;
    if (!vx_buf_reserve(&c->out, (size_t)n + 9 * ((size_t)n / c->peer_max_frame + 1))) {
        c->nomem = true;
        return off;
    }
    while (off < stop) {
        size_t size = stop - off < c->peer_max_frame ? stop - off : c->peer_max_frame;
        put_head(c, size, F_DATA, off + size == total ? FL_END_STREAM : 0, s->sid);
        put_bytes(c, body + off, size);
        off += size;
    }
    if (off < total)
        return off;
    end_local(c, s);
    return total;
}

/* Frame more of a stream's stored body; true if the stream still exists afterwards. */
static bool resume_stream(vx_h2 *c, vx_stream *s)
{
    size_t off = write_data(c, s, s->body, s->body_len, s->body_off);
    if (off == s->body_len)
        return false; /* body complete: end_local freed the body and maybe the stream */
    s->body_off = off;
    return true;
}

static void resume_bodies(vx_h2 *c)
{
    vx_stream *next;
    for (vx_stream *s = c->bhead; s; s = next) {
        next = s->bnext;
        if (c->budget <= 0) {
            c->deferred = true;
            return;
        }
        if (c->conn_send_window <= 0)
            return;
        if (s->send_window > 0 && s->body != NULL)
            resume_stream(c, s);
    }
}

int vx_h2_send_request(vx_h2 *c, const uint8_t *method, size_t method_len, const uint8_t *path,
                       size_t path_len, const vx_h2_header *headers, size_t n_headers,
                       const uint8_t *body, size_t body_len, uint32_t *sid_out)
{
    if (c->refusal)
        return VX_H2_REFUSED;
    if (c->next_sid > VX_H2_MAX_STREAM_ID)
        return VX_H2_REFUSED;
    uint32_t sid = (uint32_t)c->next_sid;
    vx_stream *s = add_stream(c, sid);
    if (s == NULL) {
        c->nomem = true;
        return VX_H2_NOMEM;
    }
    c->next_sid += 2;
    *sid_out = sid;
    if (body_len == 0) {
        write_headers(c, sid, method, method_len, path, path_len, headers, n_headers,
                      FL_END_HEADERS | FL_END_STREAM);
        s->tx_open = false;
        return c->nomem ? VX_H2_NOMEM : VX_H2_OK;
    }
    write_headers(c, sid, method, method_len, path, path_len, headers, n_headers, FL_END_HEADERS);
    size_t sent = write_data(c, s, body, body_len, 0);
    if (sent < body_len) {
        /* Keep the rest: the caller's buffer may be reused as soon as we return. */
        s->body = malloc(body_len - sent);
        if (s->body == NULL) {
            c->nomem = true;
            return VX_H2_NOMEM;
        }
        memcpy(s->body, body + sent, body_len - sent);
        s->body_len = body_len - sent;
        s->body_off = 0;
        block(c, s);
    }
    return c->nomem ? VX_H2_NOMEM : VX_H2_OK;
}

const uint8_t *vx_h2_output(vx_h2 *c, size_t *n)
{
    if (c->deferred && c->budget > 0) {
        c->deferred = false;
        resume_bodies(c);
    }
    c->budget = VX_H2_DATA_PER_CALL;
    *n = c->out.len;
    return c->out.p;
}

void vx_h2_output_done(vx_h2 *c)
{
    vx_buf_reset(&c->out, KEEP_OUT);
}

bool vx_h2_data_pending(const vx_h2 *c)
{
    return c->deferred;
}

bool vx_h2_has_output(const vx_h2 *c)
{
    return c->out.len > 0 || c->deferred;
}

/* Connection credit is handed back in large WINDOW_UPDATEs (half the window), unless the peer
 * may send no more than what is held back: streams whose clients stopped reading withhold
 * their part of the window, and credit held back for batching under them would starve every
 * other stream on the connection. (Called on each credit and on each DATA frame received.) */
static void flush_connection_credit(vx_h2 *c)
{
    int64_t credit = c->conn_unacked;
    if (credit > 0 &&
        (credit >= CONNECTION_WINDOW_UPDATE_THRESHOLD || credit >= c->conn_recv_window)) {
        put_u32_frame(c, F_WINDOW_UPDATE, 0, (uint32_t)credit);
        c->conn_recv_window += credit;
        c->conn_unacked = 0;
    }
}

static void credit_connection(vx_h2 *c, int64_t n)
{
    c->conn_unacked += n;
    flush_connection_credit(c);
}

int vx_h2_acknowledge(vx_h2 *c, uint32_t sid, int64_t n)
{
    vx_stream *s = find(c, sid);
    if (s == NULL && !opened(c, sid))
        return VX_H2_ERROR;
    if (n <= 0)
        return VX_H2_OK;
    credit_connection(c, n);
    if (s != NULL && s->rx == RX_RECEIVING_BODY) {
        int64_t credit = s->unacked + n;
        if (credit >= STREAM_WINDOW_UPDATE_THRESHOLD) {
            put_u32_frame(c, F_WINDOW_UPDATE, sid, (uint32_t)credit);
            s->recv_window += credit;
            credit = 0;
        }
        s->unacked = credit;
    }
    return VX_H2_OK;
}

int vx_h2_set_tag(vx_h2 *c, uint32_t sid, uint32_t tag)
{
    vx_stream *s = find(c, sid);
    if (s == NULL)
        return VX_H2_ERROR;
    s->tag = tag;
    return VX_H2_OK;
}

uint32_t vx_h2_tag(const vx_h2 *c, uint32_t sid)
{
    const vx_stream *s = find(c, sid);
    return s == NULL ? 0 : s->tag;
}

void vx_h2_reset_stream(vx_h2 *c, uint32_t sid, uint32_t error_code)
{
    vx_stream *s = find(c, sid);
    if (s == NULL)
        return;
    remove_stream(c, s);
    put_u32_frame(c, F_RST_STREAM, sid, error_code);
}

void vx_h2_send_ping(vx_h2 *c, const uint8_t opaque[8])
{
    put_head(c, 8, F_PING, 0, 0);
    put_bytes(c, opaque, 8);
}

void vx_h2_close(vx_h2 *c, uint32_t error_code)
{
    if (!c->goaway_sent)
        queue_goaway(c, error_code, "", 0);
    c->refusal = "connection closed locally";
}

/* ------------------------------------------------------------------------------ receiving */

static void end_remote(vx_h2 *c, vx_stream *s)
{
    s->rx = RX_REMOTE_CLOSED;
    if (!s->tx_open) {
        remove_stream(c, s);
    } else if (s->body != NULL) {
        /* The response is complete while part of our body still waits for window: stop the
         * upload (RFC 9113 section 8.1) rather than hold the stream for a window. */
        vx_h2_reset_stream(c, s->sid, VX_H2_CANCEL);
    }
}

/* Strip padding from [*start, *stop). */
static int unpad(vx_h2 *c, const uint8_t *buf, size_t *start, size_t *stop)
{
    if (*start == *stop)
        return fail(c, VX_H2_FRAME_SIZE_ERROR, "PADDED frame without a pad length");
    size_t pad = buf[*start];
    if (pad >= *stop - *start)
        return fail(c, VX_H2_PROTOCOL_ERROR, "padding as long as the frame payload");
    *start += 1;
    *stop -= pad;
    return VX_H2_OK;
}

static int on_data(vx_h2 *c, uint8_t flags, uint32_t sid, const uint8_t *buf, size_t start,
                   size_t stop)
{
    int64_t flow = (int64_t)(stop - start);
    if (c->conn_recv_window - flow < 0)
        return fail(c, VX_H2_FLOW_CONTROL_ERROR, "DATA exceeds the connection receive window");
    c->conn_recv_window -= flow;
    flush_connection_credit(c);
    if ((flags & FL_PADDED) && unpad(c, buf, &start, &stop) != VX_H2_OK)
        return VX_H2_ERROR;
    vx_stream *s = find(c, sid);
    if (s == NULL || s->rx != RX_RECEIVING_BODY) {
        /* The caller never sees these bytes, so the codec hands back their connection credit. */
        credit_connection(c, flow);
        if (s == NULL) {
            if (!opened(c, sid))
                return fail(c, VX_H2_PROTOCOL_ERROR, "DATA on stream %u, which we never opened",
                            sid);
        } else {
            stream_error(c, s,
                         s->rx == RX_AWAITING_RESPONSE ? VX_H2_PROTOCOL_ERROR : VX_H2_STREAM_CLOSED);
        }
        return VX_H2_OK;
    }
    if (s->recv_window - flow < 0)
        return fail(c, VX_H2_FLOW_CONTROL_ERROR, "DATA exceeds the receive window of stream %u",
                    sid);
    s->recv_window -= flow;
    vx_h2_event *e = push_event(c, VX_EV_DATA, sid);
    if (e) {
        e->data = buf + start;
        e->len = stop - start;
        e->value = (uint32_t)flow;
        e->end_stream = flags & FL_END_STREAM;
        e->tag = s->tag;
    }
    if (flags & FL_END_STREAM)
        end_remote(c, s);
    return VX_H2_OK;
}

static bool field_name_is(const vx_h2 *c, const vx_hfield *f, const char *name, size_t n)
{
    return f->name_len == n && memcmp(c->arena.p + f->name_off, name, n) == 0;
}

/* Append the regular (non-pseudo) fields of the block to c->fields; set first/count. */
static void emit_fields(vx_h2 *c, vx_h2_event *e)
{
    vx_hfields *src = &c->block_fields;
    if (c->fields.cap - c->fields.len < src->len) {
        size_t cap = c->fields.cap ? c->fields.cap : 64;
        while (cap - c->fields.len < src->len)
            cap *= 2;
        vx_hfield *p = realloc(c->fields.p, cap * sizeof *p);
        if (p == NULL) {
            c->nomem = true;
            return;
        }
        c->fields.p = p;
        c->fields.cap = cap;
    }
    e->first = (uint32_t)c->fields.len;
    for (size_t i = 0; i < src->len; i++)
        if (c->arena.p[src->p[i].name_off] != ':')
            c->fields.p[c->fields.len++] = src->p[i];
    e->count = (uint32_t)(c->fields.len - e->first);
}

static int on_header_block(vx_h2 *c, uint32_t sid, const uint8_t *block, size_t n, bool end_stream)
{
    /* Decode even for streams we dropped: the HPACK table is shared by the connection. */
    c->block_fields.len = 0;
    int rc = vx_hpack_decode(&c->dec, block, n, &c->arena, &c->block_fields);
    if (rc == VX_HPACK_TOO_LARGE)
        return fail(c, VX_H2_ENHANCE_YOUR_CALM, "response header list over our limit");
    if (rc == VX_HPACK_NOMEM) {
        c->nomem = true;
        return fail(c, VX_H2_INTERNAL_ERROR, "out of memory decoding a header block");
    }
    if (rc != VX_HPACK_OK)
        return fail(c, VX_H2_COMPRESSION_ERROR, "cannot decode header block");
    vx_stream *s = find(c, sid);
    if (s == NULL) {
        if (!opened(c, sid))
            return fail(c, VX_H2_PROTOCOL_ERROR, "HEADERS on stream %u, which we never opened", sid);
        return VX_H2_OK;
    }
    size_t pseudo = 0;
    const vx_hfields *fs = &c->block_fields;
    for (size_t i = 0; i < fs->len; i++) {
        if (fs->p[i].name_len == 0) { /* an empty field name (RFC 9113 section 8.2.1) */
            stream_error(c, s, VX_H2_PROTOCOL_ERROR);
            return VX_H2_OK;
        }
        pseudo += c->arena.p[fs->p[i].name_off] == ':';
    }
    if (s->rx == RX_AWAITING_RESPONSE) {
        /* Exactly one pseudo-header, :status, first, three digits (RFC 9113 section 8.3.2). */
        const uint8_t *st = NULL;
        if (fs->len && field_name_is(c, &fs->p[0], ":status", 7) && fs->p[0].value_len == 3)
            st = c->arena.p + fs->p[0].value_off;
        if (pseudo != 1 || st == NULL || st[0] < '0' || st[0] > '9' || st[1] < '0' ||
            st[1] > '9' || st[2] < '0' || st[2] > '9') {
            stream_error(c, s, VX_H2_PROTOCOL_ERROR);
            return VX_H2_OK;
        }
        uint32_t code = (uint32_t)((st[0] - '0') * 100 + (st[1] - '0') * 10 + (st[2] - '0'));
        if (code < 200) {
            if (end_stream || code == 101)
                stream_error(c, s, VX_H2_PROTOCOL_ERROR);
            return VX_H2_OK; /* informational: the final response follows */
        }
        s->rx = RX_RECEIVING_BODY;
        vx_h2_event *e = push_event(c, VX_EV_RESPONSE, sid);
        if (e) {
            e->value = code;
            e->end_stream = end_stream;
            emit_fields(c, e);
        }
        if (end_stream)
            end_remote(c, s);
    } else if (s->rx == RX_RECEIVING_BODY) {
        if (!end_stream || pseudo) {
            stream_error(c, s, VX_H2_PROTOCOL_ERROR); /* malformed trailers */
            return VX_H2_OK;
        }
        vx_h2_event *e = push_event(c, VX_EV_TRAILERS, sid);
        if (e)
            emit_fields(c, e);
        end_remote(c, s);
    } else {
        stream_error(c, s, VX_H2_STREAM_CLOSED);
    }
    return VX_H2_OK;
}

static int on_headers(vx_h2 *c, uint8_t flags, uint32_t sid, const uint8_t *buf, size_t start,
                      size_t stop)
{
    if ((flags & FL_PADDED) && unpad(c, buf, &start, &stop) != VX_H2_OK)
        return VX_H2_ERROR;
    if (flags & FL_PRIORITY) {
        start += 5; /* stream dependency and weight: prioritisation is not ours to do */
        if (start > stop)
            return fail(c, VX_H2_FRAME_SIZE_ERROR, "HEADERS too short for its priority fields");
    }
    if (flags & FL_END_HEADERS)
        return on_header_block(c, sid, buf + start, stop - start, flags & FL_END_STREAM);
    if (!sid)
        return fail(c, VX_H2_PROTOCOL_ERROR, "HEADERS on stream 0");
    c->hb_sid = sid;
    c->hb.len = 0;
    c->hb_frames = 0;
    c->hb_end_stream = flags & FL_END_STREAM;
    if (!vx_buf_append(&c->hb, buf + start, stop - start)) {
        c->nomem = true;
        return fail(c, VX_H2_INTERNAL_ERROR, "out of memory");
    }
    c->state = P_CONTINUATION;
    return VX_H2_OK;
}

static int on_continuation(vx_h2 *c, uint8_t flags, uint32_t sid, const uint8_t *buf,
                           size_t start, size_t stop)
{
    if (sid != c->hb_sid)
        return fail(c, VX_H2_PROTOCOL_ERROR,
                    "CONTINUATION for another stream inside a header block");
    if (c->hb.len + (stop - start) > VX_H2_MAX_HEADER_BLOCK)
        return fail(c, VX_H2_ENHANCE_YOUR_CALM, "header block too large");
    if (++c->hb_frames > VX_H2_MAX_CONTINUATIONS)
        return fail(c, VX_H2_ENHANCE_YOUR_CALM, "header block in too many CONTINUATION frames");
    if (!vx_buf_append(&c->hb, buf + start, stop - start)) {
        c->nomem = true;
        return fail(c, VX_H2_INTERNAL_ERROR, "out of memory");
    }
    if (!(flags & FL_END_HEADERS))
        return VX_H2_OK;
    c->hb_sid = 0;
    c->state = P_NORMAL;
    int rc = on_header_block(c, sid, c->hb.p, c->hb.len, c->hb_end_stream);
    vx_buf_reset(&c->hb, KEEP_BLOCK);
    return rc;
}

static int on_rst_stream(vx_h2 *c, uint32_t sid, const uint8_t *buf, size_t start, size_t stop)
{
    if (stop - start != 4)
        return fail(c, VX_H2_FRAME_SIZE_ERROR, "RST_STREAM payload must be 4 bytes");
    vx_stream *s = find(c, sid);
    if (s == NULL) {
        if (!opened(c, sid))
            return fail(c, VX_H2_PROTOCOL_ERROR, "RST_STREAM on stream %u, which we never opened",
                        sid);
        return VX_H2_OK;
    }
    remove_stream(c, s);
    vx_h2_event *e = push_event(c, VX_EV_RESET, sid);
    if (e)
        e->value = be32(buf + start);
    return VX_H2_OK;
}

static int shift_send_windows(vx_h2 *c, int64_t delta)
{
    /* RFC 9113 section 6.9.2: a new INITIAL_WINDOW_SIZE moves every open stream's window by the
     * difference, possibly below zero. */
    for (uint32_t i = 0; i < c->map_cap; i++) {
        vx_stream *s = c->slots[i];
        if (s == NULL)
            continue;
        s->send_window += delta;
        if (s->send_window > VX_H2_MAX_WINDOW)
            return fail(c, VX_H2_FLOW_CONTROL_ERROR,
                        "INITIAL_WINDOW_SIZE overflows a stream window");
    }
    if (delta > 0 && c->bhead)
        resume_bodies(c);
    return VX_H2_OK;
}

static int on_settings(vx_h2 *c, uint8_t flags, uint32_t sid, const uint8_t *buf, size_t start,
                       size_t stop)
{
    bool first = c->state == P_PREFACE;
    if (sid)
        return fail(c, VX_H2_PROTOCOL_ERROR, "SETTINGS on a stream");
    if (flags & FL_ACK) {
        if (first || stop != start)
            return fail(c, first ? VX_H2_PROTOCOL_ERROR : VX_H2_FRAME_SIZE_ERROR,
                        "bad SETTINGS ACK");
        return VX_H2_OK;
    }
    if ((stop - start) % 6)
        return fail(c, VX_H2_FRAME_SIZE_ERROR, "SETTINGS payload is not a multiple of 6 bytes");
    uint32_t old_limit = c->max_streams;
    uint32_t limit = first ? VX_H2_MAX_CONCURRENT_STREAMS_CAP : old_limit; /* absent: unlimited */
    int64_t delta = 0;
    for (size_t off = start; off < stop; off += 6) {
        uint32_t ident = (uint32_t)buf[off] << 8 | buf[off + 1];
        uint32_t value = be32(buf + off + 2);
        switch (ident) {
        case 3: /* MAX_CONCURRENT_STREAMS */
            limit = value < VX_H2_MAX_CONCURRENT_STREAMS_CAP ? value : VX_H2_MAX_CONCURRENT_STREAMS_CAP;
            break;
        case 4: /* INITIAL_WINDOW_SIZE */
            if (value > VX_H2_MAX_WINDOW)
                return fail(c, VX_H2_FLOW_CONTROL_ERROR, "INITIAL_WINDOW_SIZE above 2**31-1");
            delta += (int64_t)value - c->peer_initial_window;
            c->peer_initial_window = value;
            break;
        case 5: /* MAX_FRAME_SIZE */
            if (value < 16384 || value > MAX_PEER_FRAME_SIZE)
                return fail(c, VX_H2_PROTOCOL_ERROR, "MAX_FRAME_SIZE %u out of range", value);
            c->peer_max_frame = value;
            break;
        case 1: /* HEADER_TABLE_SIZE: bounds our encoder's table, which we never use; a decoder
                 * may still insist on a size update after its limit shrinks (RFC 7541 4.2) */
            if (value < 4096 && !c->table_zeroed)
                c->table_update = true;
            break;
        case 2: /* ENABLE_PUSH */
            if (value != 0)
                return fail(c, VX_H2_PROTOCOL_ERROR, "a server must not enable push");
            break;
        default:
            break;
        }
    }
    put_head(c, 0, F_SETTINGS, FL_ACK, 0);
    if (delta && shift_send_windows(c, delta) != VX_H2_OK)
        return VX_H2_ERROR;
    c->max_streams = limit;
    if (first)
        c->state = P_NORMAL;
    if (first || limit != old_limit) {
        vx_h2_event *e = push_event(c, VX_EV_SETTINGS, limit);
        (void)e;
    }
    return VX_H2_OK;
}

static int on_ping(vx_h2 *c, uint8_t flags, uint32_t sid, const uint8_t *buf, size_t start,
                   size_t stop)
{
    if (sid)
        return fail(c, VX_H2_PROTOCOL_ERROR, "PING on a stream");
    if (stop - start != 8)
        return fail(c, VX_H2_FRAME_SIZE_ERROR, "PING payload must be 8 bytes");
    if (!(flags & FL_ACK)) {
        put_head(c, 8, F_PING, FL_ACK, 0);
        put_bytes(c, buf + start, 8);
    } else {
        vx_h2_event *e = push_event(c, VX_EV_PING_ACK, 0);
        if (e) {
            e->data = buf + start;
            e->len = 8;
        }
    }
    return VX_H2_OK;
}

static int on_goaway(vx_h2 *c, uint32_t sid, const uint8_t *buf, size_t start, size_t stop)
{
    if (sid)
        return fail(c, VX_H2_PROTOCOL_ERROR, "GOAWAY on a stream");
    if (stop - start < 8)
        return fail(c, VX_H2_FRAME_SIZE_ERROR, "GOAWAY payload shorter than 8 bytes");
    uint32_t last = be32(buf + start) & 0x7FFFFFFF;
    uint32_t code = be32(buf + start + 4);
    /* Forget the streams the peer never processed; removal can move entries, so rescan. */
    for (uint32_t i = 0; i < c->map_cap;) {
        vx_stream *s = c->slots[i];
        if (s != NULL && s->sid > last)
            remove_stream(c, s);
        else
            i++;
    }
    c->refusal = "peer sent GOAWAY";
    vx_h2_event *e = push_event(c, VX_EV_GOAWAY, last);
    if (e) {
        e->value = code;
        e->data = buf + start + 8;
        e->len = stop - start - 8;
    }
    return VX_H2_OK;
}

static int on_window_update(vx_h2 *c, uint32_t sid, const uint8_t *buf, size_t start, size_t stop)
{
    if (stop - start != 4)
        return fail(c, VX_H2_FRAME_SIZE_ERROR, "WINDOW_UPDATE payload must be 4 bytes");
    uint32_t increment = be32(buf + start) & 0x7FFFFFFF;
    if (!sid) {
        if (!increment)
            return fail(c, VX_H2_PROTOCOL_ERROR, "connection WINDOW_UPDATE of 0");
        c->conn_send_window += increment;
        if (c->conn_send_window > VX_H2_MAX_WINDOW)
            return fail(c, VX_H2_FLOW_CONTROL_ERROR, "connection send window above 2**31-1");
        if (c->bhead)
            resume_bodies(c);
        return VX_H2_OK;
    }
    vx_stream *s = find(c, sid);
    if (s == NULL) {
        if (!opened(c, sid))
            return fail(c, VX_H2_PROTOCOL_ERROR, "WINDOW_UPDATE on stream %u, never opened", sid);
        return VX_H2_OK; /* the body finished before the update arrived */
    }
    if (!increment) {
        stream_error(c, s, VX_H2_PROTOCOL_ERROR);
        return VX_H2_OK;
    }
    s->send_window += increment;
    if (s->send_window > VX_H2_MAX_WINDOW)
        stream_error(c, s, VX_H2_FLOW_CONTROL_ERROR);
    else if (s->body != NULL && c->conn_send_window > 0)
        resume_stream(c, s);
    return VX_H2_OK;
}

static int dispatch(vx_h2 *c, uint8_t type, uint8_t flags, uint32_t sid, const uint8_t *buf,
                    size_t start, size_t stop)
{
    if (c->state == P_PREFACE) {
        if (type == F_SETTINGS)
            return on_settings(c, flags, sid, buf, start, stop);
        return fail(c, VX_H2_PROTOCOL_ERROR, "server preface must start with SETTINGS");
    }
    if (c->state == P_CONTINUATION) {
        if (type == F_CONTINUATION)
            return on_continuation(c, flags, sid, buf, start, stop);
        return fail(c, VX_H2_PROTOCOL_ERROR, "frame inside a header block");
    }
    switch (type) {
    case F_DATA:
        return on_data(c, flags, sid, buf, start, stop);
    case F_HEADERS:
        return on_headers(c, flags, sid, buf, start, stop);
    case F_PRIORITY:
        return VX_H2_OK; /* deprecated by RFC 9113; a client has nothing to schedule by it */
    case F_RST_STREAM:
        return on_rst_stream(c, sid, buf, start, stop);
    case F_SETTINGS:
        return on_settings(c, flags, sid, buf, start, stop);
    case F_PUSH_PROMISE:
        return fail(c, VX_H2_PROTOCOL_ERROR, "PUSH_PROMISE although we disabled push");
    case F_PING:
        return on_ping(c, flags, sid, buf, start, stop);
    case F_GOAWAY:
        return on_goaway(c, sid, buf, start, stop);
    case F_WINDOW_UPDATE:
        return on_window_update(c, sid, buf, start, stop);
    default: /* F_CONTINUATION */
        return fail(c, VX_H2_PROTOCOL_ERROR, "CONTINUATION outside a header block");
    }
}

/* Handle every complete frame in buf; return the offset of the first incomplete one. */
static size_t parse(vx_h2 *c, const uint8_t *buf, size_t end, int *rc)
{
    size_t pos = 0;
    *rc = VX_H2_OK;
    while (end - pos >= 9) {
        const uint8_t *h = buf + pos;
        size_t length = (size_t)h[0] << 16 | (size_t)h[1] << 8 | h[2];
        if (length > VX_H2_LOCAL_MAX_FRAME_SIZE) {
            *rc = fail(c, VX_H2_FRAME_SIZE_ERROR, "%zu-byte frame exceeds our maximum frame size",
                       length);
            return pos;
        }
        size_t start = pos + 9, stop = start + length;
        if (stop > end) {
            c->need = 9 + length;
            return pos;
        }
        pos = stop;
        uint8_t type = h[3];
        if (type < 10) {
            *rc = dispatch(c, type, h[4], be32(h + 5) & 0x7FFFFFFF, buf, start, stop);
        } else if (c->hb_sid) {
            *rc = fail(c, VX_H2_PROTOCOL_ERROR, "frame inside a header block");
        }
        /* Unknown frame types are ignored (RFC 9113 section 4.1). */
        if (*rc == VX_H2_OK && c->nomem)
            *rc = fail(c, VX_H2_INTERNAL_ERROR, "out of memory");
        if (*rc != VX_H2_OK)
            return pos;
    }
    c->need = 9;
    return pos;
}

int vx_h2_receive(vx_h2 *c, const uint8_t *data, size_t n)
{
    c->nev = 0;
    c->fields.len = 0;
    vx_buf_reset(&c->arena, KEEP_ARENA);
    if (c->ev_cap > KEEP_EVENTS) {
        free(c->ev);
        c->ev = NULL;
        c->ev_cap = 0;
    }
    if (c->fields.cap > KEEP_FIELDS) {
        /* A read full of header blocks of one-byte fields can make this large (at most about
         * 2,000 fields per 64 KiB list); it is the next read's business to need it again. */
        free(c->fields.p);
        c->fields.p = NULL;
        c->fields.cap = 0;
    }
    if (c->failed)
        return VX_H2_ERROR;
    int rc;
    vx_buf *h = &c->held[c->hi];
    while (h->len) {
        /* Complete the held frame (never more than one frame is held), then parse it. */
        size_t take = c->need - h->len < n ? c->need - h->len : n;
        if (!vx_buf_append(h, data, take)) {
            c->nomem = true;
            return fail(c, VX_H2_INTERNAL_ERROR, "out of memory");
        }
        data += take;
        n -= take;
        if (h->len < c->need)
            return VX_H2_OK;
        size_t pos = parse(c, h->p, h->len, &rc);
        if (rc != VX_H2_OK)
            return rc;
        if (pos == h->len) {
            /* Consumed. Events may point into this buffer until the next call, so any tail of
             * this read is held in the other one. */
            c->hi ^= 1;
            c->held[c->hi].len = 0;
            break;
        }
    }
    size_t pos = parse(c, data, n, &rc);
    if (rc != VX_H2_OK)
        return rc;
    if (pos < n) {
        vx_buf *tail = &c->held[c->hi];
        vx_buf_reset(tail, 2 * (VX_H2_LOCAL_MAX_FRAME_SIZE + 9));
        if (!vx_buf_append(tail, data + pos, n - pos)) {
            c->nomem = true;
            return fail(c, VX_H2_INTERNAL_ERROR, "out of memory");
        }
    }
    return VX_H2_OK;
}

const vx_h2_event *vx_h2_events(const vx_h2 *c, size_t *n)
{
    *n = c->nev;
    return c->ev;
}

const vx_hfield *vx_h2_fields(const vx_h2 *c)
{
    return c->fields.p;
}

const uint8_t *vx_h2_arena(const vx_h2 *c)
{
    return c->arena.p;
}

uint32_t vx_h2_max_concurrent_streams(const vx_h2 *c)
{
    return c->max_streams;
}

uint64_t vx_h2_next_stream_id(const vx_h2 *c)
{
    return c->next_sid;
}

size_t vx_h2_stream_count(const vx_h2 *c)
{
    return c->map_count;
}

bool vx_h2_failed(const vx_h2 *c)
{
    return c->failed;
}

uint32_t vx_h2_error_code(const vx_h2 *c)
{
    return c->err_code;
}

const char *vx_h2_error_message(const vx_h2 *c)
{
    return c->err_msg;
}

const char *vx_h2_refusal(const vx_h2 *c)
{
    if (c->refusal)
        return c->refusal;
    return c->next_sid > VX_H2_MAX_STREAM_ID ? "stream ids exhausted" : NULL;
}

bool vx_h2_nomem(const vx_h2 *c)
{
    return c->nomem;
}
