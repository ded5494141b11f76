/* vx_shm: the shared mappings the cores live in. Plain C11 + POSIX, no Python.
 *
 * Anonymous (fd NULL): MAP_SHARED | MAP_ANONYMOUS, shared with the children forked after it
 * is made, as every core's state was from the start. On a memfd (fd not NULL): the same
 * zero-filled shared pages, plus a descriptor that another process (started before the
 * mapping existed) can receive over an AF_UNIX socket (SCM_RIGHTS) and map with
 * vx_shm_attach: how a table grows under running workers. The pages are freed when the last
 * mapping and the last descriptor are gone.
 */
#ifndef VX_SHM_H
#define VX_SHM_H

#include <stddef.h>

/* Map len zeroed bytes. With fd, on a new memfd (close-on-exec) whose descriptor is stored
 * in *fd (the caller closes it). NULL with errno set on failure (nothing left open). */
void *vx_shm_map(size_t len, const char *name, int *fd);

/* Map the whole of the memfd fd (its size stored in *len); fd stays the caller's. NULL with
 * errno set: EINVAL for an empty file, else fstat's or mmap's errno. */
void *vx_shm_attach(int fd, size_t *len);

#endif
