/* Buffer arguments of hpc-elastic's C extensions (kernels/detreduce.c, kernels/dl2.c): a C-contiguous buffer of
   one element type, or a ValueError naming the argument.  Included by each extension's one source file, so the
   functions are static there. */

#ifndef HPC_ELASTIC_PYBUFFER_H
#define HPC_ELASTIC_PYBUFFER_H

#include <Python.h>
#include <string.h>

typedef struct {
    Py_buffer view;
    int held;
} buf_t;

static void release(buf_t *b) {
    if (b->held) {
        PyBuffer_Release(&b->view);
        b->held = 0;
    }
}

/* kind: 'f' float32, 'd' float64, 'q' int64, 'B' uint8 */
static int acquire(PyObject *obj, buf_t *b, char kind, int writable, const char *name) {
    int flags = PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | (writable ? PyBUF_WRITABLE : 0);
    b->held = 0;
    if (PyObject_GetBuffer(obj, &b->view, flags) != 0) {
        PyErr_Format(PyExc_ValueError, "%s must be a C-contiguous%s buffer", name, writable ? " writable" : "");
        return -1;
    }
    b->held = 1;
    const char *fmt = b->view.format ? b->view.format : "B";
    size_t flen = strlen(fmt);
    char last = flen ? fmt[flen - 1] : 'B';
    if (flen > 1 && fmt[0] != '<' && fmt[0] != '=' && fmt[0] != '@') {
        last = '?';
    }
    int ok = 0;
    const char *want = "?";
    switch (kind) {
    case 'f':
        ok = (last == 'f' && b->view.itemsize == 4);
        want = "float32";
        break;
    case 'd':
        ok = (last == 'd' && b->view.itemsize == 8);
        want = "float64";
        break;
    case 'q':
        ok = ((last == 'q' || last == 'l') && b->view.itemsize == 8);
        want = "int64";
        break;
    case 'B':
        ok = (last == 'B' && b->view.itemsize == 1);
        want = "uint8";
        break;
    default:
        ok = 0;
    }
    if (!ok) {
        PyErr_Format(PyExc_ValueError, "%s must hold %s, got format '%s' with itemsize %zd", name, want, fmt,
                     b->view.itemsize);
        release(b);
        return -1;
    }
    return 0;
}

#endif
