/* vx_shm: see vx_shm.h. */
#ifndef _GNU_SOURCE
/* MAP_ANONYMOUS and memfd_create are Linux/BSD extensions that -std=c11 hides. */
#define _GNU_SOURCE
#endif

#include "vx_shm.h"

#include <errno.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

void *vx_shm_map(size_t len, const char *name, int *fd)
{
    if (fd == NULL) {
        void *mem = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
        return mem == MAP_FAILED ? NULL : mem;
    }
    int f = memfd_create(name, MFD_CLOEXEC);
    if (f < 0)
        return NULL;
    /* ftruncate extends with zeros, so a memfd mapping starts zeroed as an anonymous one. */
    void *mem = ftruncate(f, (off_t)len) == 0
                    ? mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_SHARED, f, 0)
                    : MAP_FAILED;
    if (mem == MAP_FAILED) {
        int saved = errno;
        close(f);
        errno = saved;
        return NULL;
    }
    *fd = f;
    return mem;
}

void *vx_shm_attach(int fd, size_t *len)
{
    struct stat st;
    if (fstat(fd, &st) != 0)
        return NULL;
    if (st.st_size <= 0) {
        errno = EINVAL;
        return NULL;
    }
    void *mem = mmap(NULL, (size_t)st.st_size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (mem == MAP_FAILED)
        return NULL;
    *len = (size_t)st.st_size;
    return mem;
}
