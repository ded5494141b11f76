/* bind_sink.h: a streamed answer's reads written to the client from C (the "direct path"),
 * and the read buffer of the native upstream readers.
 *
 * Both native upstream readers use it: the HTTP/1.1 reader (bind_h1resp.c, one sink per
 * connection) and the HTTP/2 codec (bind_h2.c, one sink per stream). Egress asks the relay for
 * a stream's sink once its head is in (velox.relay.exchange.Exchange.direct_route: nothing
 * observes or translates the answer); from then on each upstream read of that stream that the
 * Python path would pass through untouched goes to the client's transport in one write, with
 * the meter's, the access log's, the exchange's and the attempt's bookkeeping kept exactly as
 * the Python path keeps it. Anything else (a usage chunk, half an event, a paused client) is
 * left to the Python path.
 */
#ifndef VX_BIND_SINK_H
#define VX_BIND_SINK_H

#include "bind.h"

/* The objects a sink writes through, in the order direct() takes them. */
enum { VXS_CONN, VXS_WRITE, VXS_SSE, VXS_EXCHANGE, VXS_ATTEMPT, VXS_N };

/* The attribute names the sink reads and writes (interned once per owner). */
enum {
    SN_OUT, SN_Q, SN_WRITE_PAUSED, SN_CLOSED, SN_OUT_HEAD, SN_PENDING, SN_SKIPPING, SN_EVENTS,
    SN_RELAYED, SN_STREAM_BYTES, SN_TAIL, SN_LAST_ACTIVITY, SN_WITHHELD, SN_STRIP, SN_NAMES
};

/* Over this the client connection's send queue writes a piece (ingress's WHOLE_BYTES). */
#define VXB_SINK_MAX (64 * 1024)

typedef struct {
    PyObject *name[SN_NAMES];
    PyObject *two_lf; /* b"\n\n": the exchange's tail after a whole event */
} vxb_sink_names;

typedef struct {
    PyObject *o[VXS_N]; /* all NULL while the sink is off */
    int chunked;        /* the client's answer is chunked (not HTTP/1.0) */
    int strip;          /* the meter removes the usage the gateway asked for (sse.strip) */
    /* Where each attribute the sink reads or writes lives in its object, found once per
     * stream from the class's member descriptor (all of them are __slots__), or -1 for the
     * generic getattr/setattr: a read per event then skips the type lookup, the descriptor
     * call and PyMember_GetOne (about a third of the sink's own time in a perf profile). */
    Py_ssize_t off[SN_NAMES];
} vxb_sink;

int vxb_sink_names_init(vxb_sink_names *names);
void vxb_sink_names_clear(vxb_sink_names *names);

/* Turn the sink on: args are (conn, write, sse, exchange, attempt, chunked). 0 or -1. */
int vxb_sink_set(vxb_sink *sink, const vxb_sink_names *names, PyObject *const *args);
void vxb_sink_clear(vxb_sink *sink);
int vxb_sink_traverse(const vxb_sink *sink, visitproc visit, void *arg);

/* Write the read p[0 .. n) to the client when the Python path would pass it as is: 1 written
 * (*paused: the client's transport paused during the write, so egress must withhold), 0 left
 * to the Python path, -1 error. */
int vxb_sink_write(const vxb_sink *sink, const vxb_sink_names *names, const char *p, size_t n,
                   int *paused);

/* Add n to the int attribute `name` of o. 0 or -1. */
int vxb_add(PyObject *o, PyObject *name, Py_ssize_t n);

/* What both readers (uvloop's BufferedProtocol in C) need besides: their read buffer of n
 * bytes and its writable memoryview (0, or -1 with an exception; the caller frees buf after
 * the view), buffer_updated's argument checked against it (0 or -1), and their method names
 * interned. */
int vxb_reader_buffer(size_t n, char **buf, PyObject **view);
int vxb_reader_nbytes(PyObject *arg, size_t max, size_t *n);
int vxb_intern(PyObject **out, const char *const *names, int n);

#endif
