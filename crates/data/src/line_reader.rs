//! Line-by-line reading of UTF-8 text files with line numbers and clear errors.

use std::fs::File;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};

use crate::error::{Error, Result};

/// The UTF-8 encoding of U+FEFF, the byte-order mark.
const UTF8_BOM: &[u8] = b"\xEF\xBB\xBF";

/// Reads a text file one line at a time, checking UTF-8 and counting lines.
///
/// Line endings `\n` and `\r\n` are both accepted and stripped, and so is a byte-order
/// mark at the start of the file. A final line without a
/// newline is returned like any other.
pub(crate) struct LineReader {
    path: PathBuf,
    reader: BufReader<File>,
    buffer: Vec<u8>,
    line: usize,
}

impl LineReader {
    /// Opens `path`. `what` says what the file should hold; it appears in the error
    /// returned when the file is empty.
    pub(crate) fn open(path: &Path, what: &'static str) -> Result<Self> {
        let file = File::open(path).map_err(|source| Error::Io {
            path: path.to_path_buf(),
            source,
        })?;
        let empty = file
            .metadata()
            .map_err(|source| Error::Io {
                path: path.to_path_buf(),
                source,
            })?
            .len()
            == 0;
        if empty {
            return Err(Error::EmptyFile {
                path: path.to_path_buf(),
                what,
            });
        }
        Ok(LineReader {
            path: path.to_path_buf(),
            reader: BufReader::new(file),
            buffer: Vec::new(),
            line: 0,
        })
    }

    /// The file being read.
    pub(crate) fn path(&self) -> &Path {
        &self.path
    }

    /// Returns the next line (without its line ending) and its 1-based number, or
    /// `None` at the end of the file.
    pub(crate) fn next_line(&mut self) -> Result<Option<(usize, &str)>> {
        self.buffer.clear();
        let read = self
            .reader
            .read_until(b'\n', &mut self.buffer)
            .map_err(|source| Error::Io {
                path: self.path.clone(),
                source,
            })?;
        if read == 0 {
            return Ok(None);
        }
        self.line += 1;
        // A UTF-8 byte-order mark (as some Windows editors write) is not part of the text.
        if self.line == 1 && self.buffer.starts_with(UTF8_BOM) {
            self.buffer.drain(..UTF8_BOM.len());
        }
        if self.buffer.last() == Some(&b'\n') {
            self.buffer.pop();
            if self.buffer.last() == Some(&b'\r') {
                self.buffer.pop();
            }
        }
        match std::str::from_utf8(&self.buffer) {
            Ok(text) => Ok(Some((self.line, text))),
            Err(err) => Err(Error::InvalidUtf8 {
                path: self.path.clone(),
                line: self.line,
                byte_offset: err.valid_up_to(),
            }),
        }
    }

    /// Reads to the end and returns the total number of lines in the file (lines
    /// already read included). Contents are not checked.
    pub(crate) fn count_to_end(&mut self) -> Result<usize> {
        loop {
            self.buffer.clear();
            let read = self
                .reader
                .read_until(b'\n', &mut self.buffer)
                .map_err(|source| Error::Io {
                    path: self.path.clone(),
                    source,
                })?;
            if read == 0 {
                return Ok(self.line);
            }
            self.line += 1;
        }
    }
}

/// Calls `visit(line_number, line)` for every line of `path`.
pub(crate) fn for_each_line(
    path: &Path,
    what: &'static str,
    mut visit: impl FnMut(usize, &str) -> Result<()>,
) -> Result<usize> {
    let mut reader = LineReader::open(path, what)?;
    let mut lines = 0;
    while let Some((number, line)) = reader.next_line()? {
        visit(number, line)?;
        lines = number;
    }
    Ok(lines)
}
