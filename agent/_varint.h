/* The protobuf varint reader both C extensions use (agent/_wire.c, processors/_native.c). */
#ifndef TOKENTRACE_VARINT_H
#define TOKENTRACE_VARINT_H

#include <Python.h>
#include <stdint.h>

/* A varint at data[*pos] (at most 10 bytes, ending before `end`); 0 when malformed. */
static int read_varint(const unsigned char *data, Py_ssize_t end, Py_ssize_t *pos,
                       uint64_t *value) {
    uint64_t result = 0;
    for (int shift = 0; shift < 70 && *pos < end; shift += 7) {
        unsigned char byte = data[(*pos)++];
        result |= (uint64_t)(byte & 0x7F) << shift;
        if (!(byte & 0x80)) {
            *value = result;
            return 1;
        }
    }
    return 0;
}

#endif
